"""Structured logs for both services: one JSON object per line on stderr. A record logged with
`extra={"fields": {...}}` (the access log) carries those fields as keys of its object."""

from __future__ import annotations

import json
import logging


class JsonLogFormatter(logging.Formatter):
    """ts, level, logger, msg (and exc when there is one), as one JSON object."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
