"""Reading a cluster file from disk: YAML (a SafeLoader that also reads exponent floats like 1e2) or JSON,
with errors that name the line and column. The format is in autopar/cluster.py's docstring."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .errors import ClusterError

_YAML_LOADER: Any = None


def _yaml_loader() -> Any:
    """yaml.SafeLoader that also reads exponent floats without a dot (1e2, 5E-3) as numbers (YAML 1.2)."""
    global _YAML_LOADER
    if _YAML_LOADER is None:
        import yaml

        class Loader(yaml.SafeLoader):
            pass

        Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                     re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                     list("-+0123456789"))
        _YAML_LOADER = Loader
    return _YAML_LOADER


def read_file(path: Path) -> dict:
    """The mapping a YAML/JSON cluster file holds; ClusterError naming what is wrong where."""
    if not path.is_file():
        raise ClusterError(f"cluster file {str(path)!r} does not exist (pass a path, a dict or a shorthand "
                           f"string like '1x8xA100-80GB').")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        # json, not yaml: PyYAML (YAML 1.1) reads JSON numbers like 1e2 as strings and rejects tab indents.
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ClusterError(f"malformed cluster file {str(path)!r} at line {e.lineno}, column {e.colno}: "
                               f"{e.msg}. Fix the JSON there (commas, quotes, closing brackets).") from None
        if not isinstance(data, dict):
            raise ClusterError(f"cluster file {str(path)!r} must hold a mapping with a 'nodes' list, "
                               f"got {type(data).__name__}.")
        return data
    import yaml

    try:
        data = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ClusterError(f"malformed cluster file {str(path)!r}{at}: {e.problem or e}. "
                           f"Fix the YAML there (indentation, ':' after keys, closing brackets).") from None
    except yaml.YAMLError as e:
        raise ClusterError(f"malformed cluster file {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ClusterError(f"cluster file {str(path)!r} must hold a mapping with a 'nodes' list, "
                           f"got {type(data).__name__}.")
    return data


__all__ = ["read_file"]
