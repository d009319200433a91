"""Database-side guarantees: append-only triggers, per dialect."""

from __future__ import annotations

from ledger_store.models import APPEND_ONLY_TABLES, REDACTABLE_KINDS

_KINDS = ", ".join(f"'{kind}'" for kind in REDACTABLE_KINDS)

# The one permitted UPDATE on entries: body -> NULL for a summarized admit/spend/withdraw entry,
# every other column unchanged.
_REDACTION = f"""NEW.body IS NULL AND OLD.body IS NOT NULL AND NEW.seq = OLD.seq AND NEW.kind = OLD.kind
    AND NEW.time = OLD.time AND NEW.leaf_hash = OLD.leaf_hash AND OLD.kind IN ({_KINDS})
    AND EXISTS (SELECT 1 FROM summaries WHERE OLD.seq BETWEEN summaries.first_seq AND summaries.last_seq)"""


def sqlite_triggers() -> list[str]:
    statements = [
        f"""CREATE TRIGGER IF NOT EXISTS entries_no_update BEFORE UPDATE ON entries
            WHEN NOT ({_REDACTION})
            BEGIN SELECT RAISE(ABORT, 'govtrain ledger: entries are append-only; only summarized bodies may be
            redacted'); END""",
        """CREATE TRIGGER IF NOT EXISTS entries_no_delete BEFORE DELETE ON entries
            BEGIN SELECT RAISE(ABORT, 'govtrain ledger: entries are append-only'); END""",
    ]
    for table in APPEND_ONLY_TABLES:
        for verb in ("UPDATE", "DELETE"):
            statements.append(
                f"""CREATE TRIGGER IF NOT EXISTS {table}_no_{verb.lower()} BEFORE {verb} ON {table}
                    BEGIN SELECT RAISE(ABORT, 'govtrain ledger: {table} are append-only'); END"""
            )
    return statements


def postgresql_triggers() -> list[str]:
    statements = [
        f"""CREATE OR REPLACE FUNCTION govtrain_entries_guard() RETURNS trigger AS $$
            BEGIN
              IF TG_OP = 'UPDATE' AND {_REDACTION} THEN
                RETURN NEW;
              END IF;
              RAISE EXCEPTION 'govtrain ledger: entries are append-only; only summarized bodies may be redacted';
            END $$ LANGUAGE plpgsql""",
        """CREATE OR REPLACE TRIGGER entries_guard BEFORE UPDATE OR DELETE ON entries
            FOR EACH ROW EXECUTE FUNCTION govtrain_entries_guard()""",
        """CREATE OR REPLACE FUNCTION govtrain_append_only() RETURNS trigger AS $$
            BEGIN RAISE EXCEPTION 'govtrain ledger: %% are append-only', TG_TABLE_NAME; END $$ LANGUAGE plpgsql""",  # %% for psycopg
    ]
    for table in ("entries", *APPEND_ONLY_TABLES):
        if table != "entries":
            statements.append(f"""CREATE OR REPLACE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table}
                                  FOR EACH ROW EXECUTE FUNCTION govtrain_append_only()""")
        # Row triggers do not see TRUNCATE; refuse it per statement.
        statements.append(f"""CREATE OR REPLACE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table}
                              FOR EACH STATEMENT EXECUTE FUNCTION govtrain_append_only()""")
    return statements
