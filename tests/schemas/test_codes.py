"""Error codes come from one enum: no code is a bare string where it is raised, and a code on
the wire is its plain string."""

from __future__ import annotations

import pathlib
import re

from rlfabric.schemas import ErrorCode, RolloutError, codec_for, encode, headers

ROOT = pathlib.Path(__file__).parents[2]
LIBRARY = ("bus", "engines", "trainer", "gateway", "schemas", "tensors", "cli", "launch",
           "fabric", "text")
#: where a code is given: raising a command or request failure, a `code=` / `error_code=`
RAISED = re.compile(r'(?:CommandFailed|RequestRejected)\(\s*"[a-z_]+"|\b(?:error_)?code="[a-z_]+"')


def test_no_code_is_a_bare_string_where_it_is_raised() -> None:
    bare = [f"{p.relative_to(ROOT)}: {m.group(0)}"
            for d in LIBRARY for p in (ROOT / d).rglob("*.py")
            for m in RAISED.finditer(p.read_text())
            if p.name != "codes.py"]
    assert bare == [], "use rlfabric.schemas.ErrorCode: " + "; ".join(bare)


def test_codes_are_unique_snake_case_strings() -> None:
    values = [c.value for c in ErrorCode]
    assert len(values) == len(set(values))
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", v) for v in values)
    assert ErrorCode.DIGEST_MISMATCH == "digest_mismatch"


def test_a_code_travels_as_its_string() -> None:
    err = RolloutError(request_id="r", worker_id="w", code=ErrorCode.PROMPT_TOO_LONG,
                       message="no room")
    back = codec_for(RolloutError).decode(encode(err), headers())
    assert back.code == "prompt_too_long" and type(back.code) is str
