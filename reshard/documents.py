"""The JSON and YAML documents a checkpoint carries (config.json, run_config.yaml, zarr.json, the manifest),
parsed with bounded nesting.

A document nested thousands deep ends in a RecursionError in the parser, or later wherever its values travel
(an HF config rides in the args reshard pickles into its output); no checkpoint's document nests past a few
levels, so one deeper than MAX_DEPTH is refused in one line. YAML is read with `yaml.safe_load` (names, never
objects), its depth counted on the parser's event stream before its recursive composer builds anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reshard.errors import ReshardError

MAX_DEPTH = 32  # HF configs nest 3 deep (a multimodal model's text_config.rope_scaling), Bridge's run_config 4


def _too_deep(path: Path | str) -> ReshardError:
    return ReshardError(f"{path} nests deeper than {MAX_DEPTH} levels, as no checkpoint's document does; refusing it")


def read_json(path: Path, text: str | None = None, name: str | None = None) -> Any:
    """The JSON document at `path` (or its `text`, already read); `name` says it in a refusal (default: the path)."""
    try:
        value = json.loads(path.read_text() if text is None else text)
    except RecursionError:
        raise _too_deep(name or path) from None
    except (ValueError, UnicodeError) as exc:
        raise ReshardError(f"{name or path} is not valid JSON ({exc})") from None
    stack = [(value, 1)]
    while stack:  # no recursion here either
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise _too_deep(name or path)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


def read_yaml(path: Path) -> Any:
    """The YAML document at `path`, plain values only (`yaml.safe_load`)."""
    import yaml

    try:
        text = path.read_text()
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > MAX_DEPTH:
                raise _too_deep(path)
        return yaml.safe_load(text)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ReshardError(f"{path} is not valid YAML ({str(exc).splitlines()[0]})") from None
