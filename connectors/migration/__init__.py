"""Moving a live PostgreSQL or MySQL/MariaDB table into cells (issue 53; the seed's Mezzanine migration)."""
