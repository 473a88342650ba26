"""The `rank_pattern` / `alpha_pattern` keys of adapter_config.json, matched without regular
expressions.

PEFT compiles each key into `(.*\\.)?(KEY)$` and matches it against the module path
(`model.layers.3.self_attn.q_proj`): a plain key therefore names a module by a suffix that starts
at a `.` boundary, and a key holding regex syntax can be any pattern. A pattern from an untrusted
checkpoint can backtrack for minutes, so the store accepts the keys that real checkpoints use and
refuses the rest (docs/adapter-layout.md):

- a dotted path of names (`[A-Za-z0-9_]+` separated by `.`): matches a module path equal to it or
  ending in `.KEY` (`down_proj`, `mlp.down_proj`, `model.layers.3.self_attn.q_proj`);
- the same with a leading `^`: matches only the whole module path (in PEFT's pattern `^` can only
  match where the optional prefix is empty);
- `\\.` is read as `.`, as the escaped form of the same path.

A key is at most MAX_KEY_CHARS characters; matching costs one string comparison per key and module.
"""

from __future__ import annotations

import string

MAX_KEY_CHARS = 256
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_")


def _normal_form(key: str) -> tuple[bool, str]:
    """(anchored, dotted path) of an accepted key."""
    anchored = key.startswith("^")
    return anchored, key[1:].replace("\\.", ".") if anchored else key.replace("\\.", ".")


def check_pattern_key(key: object) -> str | None:
    """None when `key` is accepted, else the reason (naming the key) for the error message."""
    if not isinstance(key, str):
        return f"{key!r} is not a string"
    if len(key) > MAX_KEY_CHARS:
        return f"{key[:40]!r}... is {len(key)} characters, over the limit of {MAX_KEY_CHARS}"
    _, path = _normal_form(key)
    names = path.split(".")
    if not all(name and _NAME_CHARS.issuperset(name) for name in names):
        return (
            f"{key!r} is not accepted: keys are module paths such as 'down_proj' or "
            "'model.layers.3.self_attn.q_proj' (names of letters, digits and '_' joined by '.', "
            "optionally anchored with a leading '^'); other regular expressions are refused"
        )
    return None


def key_matches(key: str, module_path: str) -> bool:
    """PEFT's rule for an accepted key: the whole path, or a suffix at a '.' boundary unless anchored."""
    anchored, path = _normal_form(key)
    if anchored:
        return module_path == path
    return module_path == path or module_path.endswith("." + path)


def first_matching_key(keys: list[str], module_path: str) -> str | None:
    """The first key (in the config's order, as PEFT takes it) that names `module_path`."""
    return next((k for k in keys if key_matches(k, module_path)), None)
