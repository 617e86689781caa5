"""A secret typed with the terminal's editing keys, or in a shape the op does
not take, still never reaches the WAL, the logs or the model.

A hostile (or careless) model types `Edit3dX<DEL>-Secret-999`: `cat` prints
back what the line discipline made of it (`Edit3d-Secret-999`) and the tty's
echo shows the runs between the erasures; both are redacted
(actors/procs/redact.py). A `terminal_input` whose `text` is a list is
refused by the op's schema, and its content is recorded nowhere
(actors/kernel/vault.py)."""

from __future__ import annotations

import pytest

from actors.procs.redact import MASK, Redactor, edited
from tests.security.stack import Runtime, output_of

pytestmark = pytest.mark.timeout(120)

TYPED = "Edit3dX\x7f-Secret-999"
SHOWN = "Edit3d-Secret-999"
LISTED = "list-shaped-sekrit-4242"
ECHOING = ("IFS= read -r s; printf 'got:%s\\n' \"$s\"; touch echoed.flag; sleep 30")
WAIT_FLAG = "for i in $(seq 1 400); do [ -e echoed.flag ] && exit 0; sleep 0.05; done; exit 1"


@pytest.mark.process
def test_a_secret_corrected_with_backspace_is_redacted_as_the_terminal_shows_it(
        shared: Runtime) -> None:
    results = shared.run_agent("typist-edit", [
        {"op": "terminal_start", "command": ECHOING},
        {"op": "terminal_input", "proc_id": "{last_terminal}", "text": TYPED + "\n"},
        {"op": "bash", "command": WAIT_FLAG},
        {"op": "terminal_read", "proc_id": "{last_terminal}"},
        {"op": "terminal_end", "proc_id": "{last_terminal}"},
    ])
    assert results["3.0"]["exit_code"] == 0, results["3.0"]
    seen = output_of(results["4.0"])
    assert "got:[redacted]" in seen, seen
    assert SHOWN not in seen and "Secret-999" not in seen, seen
    for piece in (SHOWN, "-Secret-999"):
        assert shared.files_holding(piece.encode()) == [], piece


@pytest.mark.process
def test_a_list_shaped_terminal_input_is_refused_and_recorded_nowhere(shared: Runtime) -> None:
    results = shared.run_agent("typist-list", [
        {"op": "terminal_start", "command": "cat"},
        {"op": "terminal_input", "proc_id": "{last_terminal}", "text": [LISTED, LISTED]},
        {"op": "terminal_end", "proc_id": "{last_terminal}"},
    ])
    assert "2.0" not in results  # never run
    rejects = [r.payload() for r in shared.writer.read_stream("agent/typist-list")
               if r.event == "schema_reject"]
    assert [p["call_id"] for p in rejects if isinstance(p, dict)] == ["2.0"], rejects
    assert "text" in str(rejects) and LISTED not in str(rejects)
    assert shared.files_holding(LISTED.encode()) == []  # WAL, transcript, ledger, trace, vault


def test_line_editing_keys_are_applied_before_redaction() -> None:
    assert edited(b"abc def\x17ghi") == b"abc ghi"
    assert edited(b"junk\x15real-one") == b"real-one"
    r = Redactor()
    r.add(b"Edit3dX\x7f-Secret-999\n")
    out = r.feed(b"Edit3dX\x08 \x08-Secret-999\r\nEdit3d-Secret-999\r\n") + r.flush()
    assert out == MASK + b"\x08 \x08" + MASK + b"\r\n" + MASK + b"\r\n"
