"""Both services log one JSON object per line, whatever the message holds."""

from __future__ import annotations

import json
import logging

from loraserve.serving.logs import JsonLogFormatter


def test_records_are_json_even_with_quotes_and_exceptions() -> None:
    fmt = JsonLogFormatter()
    rec = logging.LogRecord(
        "loraserve.store", logging.WARNING, __file__, 1, 'adapter "x"\nnot found: %s', ("s3://b/p",), None
    )
    out = json.loads(fmt.format(rec))
    assert out["level"] == "WARNING" and out["logger"] == "loraserve.store"
    assert out["msg"] == 'adapter "x"\nnot found: s3://b/p' and "\n" not in fmt.format(rec)
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("w", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "ValueError: boom" in json.loads(fmt.format(rec))["exc"]
