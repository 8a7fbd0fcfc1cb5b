"""Backups of an instance and their restores (``cellstream backup``, ``cellstream restore``): a manifest over
immutable files, each shard consistent up to a recorded added_id watermark, restored with the same added_ids.
"""
