-- Run once by the mariadb image's entrypoint when the data volume is empty,
-- after it has created MARIADB_USER/MARIADB_DATABASE.
-- The tests create and drop a database per run, so the test account needs
-- global privileges (same as scripts/services.sh grants).
CREATE USER IF NOT EXISTS 'cellstream'@'%' IDENTIFIED BY 'cellstream';
GRANT ALL PRIVILEGES ON *.* TO 'cellstream'@'%' WITH GRANT OPTION;
FLUSH PRIVILEGES;
