"""`python ops/bench.py decode [--json] [--quick]`: the work one frame costs
a receiver.

Times `broker.protocol.decode` on the worst frames that fit the size limit
(issue 11: 990 keys each holding 1,040 empty arrays; nested arrays; many
small maps; deep nesting; the 22-byte frame) and on a normal append (the hot
path), against a baseline measured in the same run: the decode corral had
before the element limit (msgpack.unpackb with only per-container limits, a
Python walk for depth, then validation). `worst_frame_decode_ms` is the
slowest hostile frame's median (target <= 20 ms); `*_ratio` is baseline over
now. `worst_frames()` is shared with other benchmarks (the busy spawn run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack

from broker import protocol
from broker.errors import ProtocolError


def worst_frames() -> dict[str, bytes]:
    """Hostile frames within every size limit (each <= 1 MiB)."""
    pack = msgpack.packb
    issue: dict[str, Any] = {"v": 1, "kind": "ping", "msg_id": "w-1"}
    issue.update({f"k{i}": [[] for _ in range(1040)] for i in range(990)})
    return {
        "keys_990x1040_empty_arrays": pack(issue),
        "arrays_10000x100_empty": pack({"v": 1, "kind": "records", "msg_id": "w-2",
                                        "records": [[[]] * 100 for _ in range(10_000)]}),
        "maps_10000x33_small": pack({"v": 1, "kind": "stats", "msg_id": "w-3", "actor": "a",
                                     "values": {"x": [[{"": 0}] * 33 for _ in range(10_000)]}}),
        "values_990x1040_empty_arrays": pack({
            "v": 1, "kind": "heartbeat", "actor": "a", "pid": 1,
            "values": {f"k{i}": [[] for _ in range(1040)] for i in range(990)}}),
        "deep_5000": b"\x91" * 5000 + b"\x01",
        "kind_is_a_list": pack({"v": 1, "kind": [], "msg_id": "x"}),
    }


def _naive_decode(frame: bytes) -> object:
    """The decode before issue 11 (the baseline): no element limit, a Python
    walk for depth, then validation."""
    limits = protocol.DEFAULT_LIMITS
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_ext_len=0,
                              max_str_len=limits.max_str_bytes,
                              max_bin_len=limits.max_bin_bytes,
                              max_array_len=limits.max_array_len,
                              max_map_len=limits.max_map_len)
    except ValueError:
        return None
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        children: Any = item.values() if isinstance(item, dict) else item
        if not isinstance(item, dict | list):
            continue
        if depth > limits.max_depth:
            return None
        stack.extend((child, depth + 1) for child in children)
    if not isinstance(obj, dict):
        return None
    kind = obj.get("kind")
    if not isinstance(kind, str):
        return None  # (the old decode raised TypeError here, and its receiver died)
    model = protocol._BY_KIND.get(kind)  # the baseline reuses the models
    if model is None:
        return None
    obj.pop("v", None)
    try:
        return model.model_validate(obj)
    except Exception:  # noqa: BLE001 - the baseline only needs the time
        return None


def _decode(frame: bytes) -> object:
    try:
        return protocol.decode(frame)
    except ProtocolError:
        return None


def _time_ms(fn: Callable[[bytes], object], frame: bytes, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(frame)
        out.append((time.perf_counter() - start) * 1000)
    return out


def run(quick: bool = False) -> dict[str, object]:
    runs = 3 if quick else 15
    baseline_runs = 1 if quick else 3
    figures: dict[str, object] = {"runs": runs, "baseline_runs": baseline_runs,
                                  "max_elements": protocol.DEFAULT_LIMITS.max_elements}
    worst = 0.0
    for name, frame in worst_frames().items():
        now = _time_ms(_decode, frame, runs)
        before = _time_ms(_naive_decode, frame, baseline_runs)
        median = statistics.median(now)
        worst = max(worst, median)
        figures[f"{name}_bytes"] = len(frame)
        figures[f"{name}_decode_ms"] = round(median, 2)
        figures[f"{name}_decode_max_ms"] = round(max(now), 2)
        figures[f"{name}_baseline_ms"] = round(statistics.median(before), 2)
        figures[f"{name}_ratio"] = round(statistics.median(before) / max(median, 1e-6), 1)
    figures["worst_frame_decode_ms"] = round(worst, 2)
    append = protocol.encode(protocol.Append(
        msg_id="m1.2.3", origin="agent-1", key="turn-7:tool_call", stream="agent-1",
        event="tool_call", payload=b'{"a":1,"b":[1,2,3]}'))
    n = 2000 if quick else 20_000
    for label, fn in (("append_decode_us", _decode), ("append_baseline_us", _naive_decode)):
        best = min(sum(_time_ms(fn, append, n)) for _ in range(3))
        figures[label] = round(best / n * 1000, 2)
    figures["append_decode_ratio"] = round(
        float(figures["append_decode_us"]) / float(figures["append_baseline_us"]), 2)  # type: ignore[arg-type]
    return figures
