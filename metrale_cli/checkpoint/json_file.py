"""A checkpoint's JSON files (config.json, tokenizer_config.json, generation_config.json, the
shard index): one reader, so that a file that is not JSON, or JSON but not an object, is one
error line wherever it is read."""

from __future__ import annotations

import json
import os
import pathlib

from metrale_cli.errors import MetraleError


def read_json_object(path: pathlib.Path, hint: str = "re-download the checkpoint's file", *,
                     optional: bool = False) -> dict:
    """``path``'s JSON object; ``optional``: {} when there is nothing at ``path`` (a directory or
    a broken link there is an error, not an absent file)."""
    if optional and not os.path.lexists(path):
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise MetraleError(f"{path} is not a readable file ({exc.strerror})", hint) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MetraleError(f"{path} is not valid JSON: {exc}", hint) from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise MetraleError(f"{path} is not valid JSON: nested too deeply", hint) from None
    if not isinstance(value, dict):
        raise MetraleError(f"{path} is not a JSON object", hint)
    return value
