"""Parser of ``data/torch_npu_schemas.txt`` (the op schemas read out of the torch-npu 2.14.0 wheel, and the DSA / MLA
ops' schemas from op-plugin's ``op_plugin_functions.yaml``)."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path

SCHEMA_FILE = Path(__file__).parent / "data" / "torch_npu_schemas.txt"


@dataclass(frozen=True)
class Arg:
    type: str
    name: str
    default: object  # inspect.Parameter.empty when required
    keyword_only: bool


@dataclass(frozen=True)
class Schema:
    name: str  # "op" or "op.overload"
    args: tuple[Arg, ...]
    returns: tuple[str, ...]


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + ([cur.strip()] if cur.strip() else [])


def _default(text: str):
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[0] in "\"'":
        return text[1:-1]
    return float(text) if "." in text or "e" in text else int(text)


def _parse(line: str) -> Schema:
    m = re.fullmatch(r"([\w.]+)\((.*)\) -> (.*)", line.strip())
    assert m, line
    name, args_text, ret = m.groups()
    args, kw_only = [], False
    for part in _split_top(args_text):
        if part == "*":
            kw_only = True
            continue
        decl, _, default = part.partition("=")
        typ, arg_name = decl.rsplit(" ", 1)
        args.append(Arg(typ, arg_name, _default(default) if default else inspect.Parameter.empty, kw_only))
    ret = ret.strip()
    returns = tuple(r.split(" ")[0] for r in _split_top(ret[1:-1])) if ret.startswith("(") else (ret.split(" ")[0],)
    return Schema(name, tuple(args), returns)


def load_schemas() -> dict[str, Schema]:
    return {s.name: s for s in map(_parse, SCHEMA_FILE.read_text().splitlines()) if s.name}
