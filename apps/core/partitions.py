"""Time series tables partitioned by day (node metrics, task log lines): each day's rows
sit in a partition of their own, made a few days ahead, and retention drops whole
partitions instead of deleting rows. A table has a DEFAULT partition for rows whose day
had no partition yet (a clock far off); retention deletes those by age."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.db import DatabaseError, connection, transaction

DAYS_AHEAD = 3


@dataclass(frozen=True)
class DailyTable:
    table: str  # the partitioned parent; its DEFAULT partition is f"{table}_default"
    column: str  # the timestamptz it is partitioned on

    @property
    def prefix(self) -> str:
        return f"{self.table}_p"

    def partition_name(self, day: date) -> str:
        return f"{self.prefix}{day:%Y%m%d}"

    def ensure_partitions(self, cursor, today: date, days_ahead: int = DAYS_AHEAD) -> list[str]:
        """Yesterday's, today's and the next `days_ahead` days' partitions; the names made."""
        created = []
        for offset in range(-1, days_ahead + 1):
            day = today + timedelta(days=offset)
            name = self.partition_name(day)
            cursor.execute("SELECT to_regclass(%s)", [name])
            if cursor.fetchone()[0] is not None:
                continue
            start = datetime(day.year, day.month, day.day, tzinfo=UTC)
            try:
                with transaction.atomic():
                    cursor.execute(
                        f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF {self.table} FOR VALUES FROM (%s) TO (%s)",
                        [start, start + timedelta(days=1)],
                    )
            except DatabaseError:
                # Rows for that day already sit in the default partition (it was missing
                # when they arrived); they stay there until retention deletes them.
                continue
            created.append(name)
        return created

    def prune_and_prepare(self, now: datetime, cutoff: datetime) -> dict:
        """The retention job's work: the coming days' partitions made, those before
        `cutoff` dropped; the names of each."""
        with connection.cursor() as cursor:
            created = self.ensure_partitions(cursor, now.date())
            dropped = self.drop_expired_partitions(cursor, cutoff)
        return {"created": created, "dropped": dropped}

    def drop_expired_partitions(self, cursor, cutoff: datetime) -> list[str]:
        """Drop every partition whose whole day is before `cutoff`; the names dropped."""
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = %s AND c.relname LIKE %s",
            [self.table, self.prefix + "%"],
        )
        dropped = []
        for (name,) in cursor.fetchall():
            day = datetime.strptime(name.removeprefix(self.prefix), "%Y%m%d").replace(tzinfo=UTC)
            if day + timedelta(days=1) <= cutoff:
                cursor.execute(f"DROP TABLE IF EXISTS {name}")
                dropped.append(name)
        # Rows that landed in the default partition (a clock far off) are few: delete them.
        cursor.execute(f"DELETE FROM {self.table}_default WHERE {self.column} < %s", [cutoff])
        return dropped
