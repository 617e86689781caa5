"""The operator's pipeline and registry commands.

See docs/pipelines.md and docs/registries.md ("Applying them:
`supervisor registry`").
"""

# ruff: noqa: PLC0415 - each path imports only what it needs

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.statedir import StateDir

if TYPE_CHECKING:
    import zmq

    from actors.writer.client import WriterClient

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_SUPERVISOR, EXIT_NO_ANSWER = 0, 1, 2, 3, 4


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"supervisor: {message}", file=sys.stderr)
    return code


def quiet_logs() -> None:
    """Library events (a generation written) are for logs, not for the operator's
    terminal: only warnings, to stderr."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def parse_inputs(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--input {pair!r}: use KEY=VALUE")
        out[key] = value
    return out


def _operator_writer(state_dir: StateDir) -> tuple[zmq.Context[zmq.Socket[bytes]], WriterClient]:
    import zmq

    from actors.writer.client import WriterClient
    from broker import auth

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    credential = auth.operator_credential(state_dir)
    return ctx, WriterClient(ctx, state_dir, "operator", timeout_s=2.0, retries=2,
                             credential=credential)


def check(target: str) -> int:
    from actors.agent import catalog
    from actors.pipelines import dsl

    catalog.install()  # the ops a pipeline's steps may name

    try:
        pipeline = dsl.load(Path(target))
    except dsl.PipelineError as exc:
        return _fail(str(exc))
    print(f"supervisor: {target}: pipeline {pipeline.name} is valid "
          f"(inputs: {', '.join(pipeline.inputs) or 'none'})")
    return EXIT_OK


def run(state_dir: StateDir, target: str, pairs: list[str], *, runner: str | None,
        wait: bool, timeout_s: float, as_json: bool) -> int:
    from actors.agent import catalog
    from actors.pipelines import runfile
    from actors.registries import store
    from broker import protocol
    from broker.errors import CorralError, RemoteError, RequestTimeoutError
    from broker.requester import new_msg_id
    from broker.statedir import check_actor_name
    from supervisor import client

    catalog.install()  # the ops a pipeline's steps may name
    try:
        inputs = parse_inputs(pairs)
        text, source = store.pipeline_source(state_dir, target)
        run_file = runfile.build(pipeline="", source=source, text=text, inputs=inputs)
        pipeline = run_file.parsed()
        runfile.check_inputs(pipeline, inputs)
        run_file = run_file.model_copy(update={"pipeline": pipeline.name})
        name = runner or f"pl-{pipeline.name[:40]}-{secrets.token_hex(3)}"
        check_actor_name(name)
    except LookupError as exc:  # an unknown name is a refusal (exit 1), not a usage error
        return _fail(str(exc).splitlines()[0])
    except (ValueError, CorralError, OSError) as exc:
        return _fail(str(exc).splitlines()[0], EXIT_USAGE)
    if not client.running(state_dir):
        return _fail(f"no supervisor for {state_dir.root}", EXIT_NO_SUPERVISOR)
    path = runfile.write(state_dir, name, run_file)
    message = protocol.SpawnRequest(msg_id=new_msg_id("sp"), name=name, task=str(path),
                                    backend="pipeline")
    try:
        client.ask(state_dir, message, timeout_s=5.0)
    except client.NoSupervisorError:
        return _fail(f"no supervisor for {state_dir.root}", EXIT_NO_SUPERVISOR)
    except RequestTimeoutError:
        return _fail(f"no answer from the supervisor of {state_dir.root}", EXIT_NO_ANSWER)
    except RemoteError as exc:
        return _fail(f"pipeline run refused: {exc.detail}")
    if not wait:
        if as_json:
            print(json.dumps({"ok": True, "runner": name, "pipeline": pipeline.name}))
        else:
            print(f"supervisor: started pipeline {pipeline.name} as {name}")
        return EXIT_OK
    return _wait(state_dir, name, timeout_s, as_json)


def _wait(state_dir: StateDir, name: str, timeout_s: float, as_json: bool) -> int:
    from actors.pipelines import report
    from broker.errors import CorralError

    ctx, writer = _operator_writer(state_dir)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                done = report.outcome(writer, state_dir, name)
            except CorralError as exc:
                return _fail(str(exc))
            if done is not None:
                break
            if time.monotonic() > deadline:
                return _fail(f"pipeline runner {name} did not end within {timeout_s:g}s",
                             EXIT_NO_ANSWER)
            time.sleep(0.1)
    finally:
        writer.close()
        ctx.destroy(linger=0)
    if as_json:
        print(json.dumps({"runner": name, **done}, sort_keys=True))
    elif done["status"] == "ok":
        print(f"supervisor: pipeline {name} ok: outputs "
              f"{json.dumps(done.get('outputs'), sort_keys=True)}")
    else:  # the reason, as --json has it; the outputs settled before it, if any
        settled = done.get("outputs")
        print(f"supervisor: pipeline {name} {done['status']}: "
              f"{done.get('error') or 'no reason recorded'}"
              f"{f' (outputs so far: {json.dumps(settled, sort_keys=True)})' if settled else ''}"
              f"; `supervisor trace {name}` shows each step")
    return EXIT_OK if done["status"] == "ok" else EXIT_FAILED


def _with_operator(state_dir: StateDir, action: Any) -> int:
    from broker.errors import CorralError, RequestTimeoutError
    from supervisor import client

    if not client.running(state_dir):
        return _fail(f"no supervisor for {state_dir.root}", EXIT_NO_SUPERVISOR)
    try:
        ctx, writer = _operator_writer(state_dir)
    except CorralError as exc:
        return _fail(str(exc))
    try:
        code: int = action(writer)
    except RequestTimeoutError:
        return _fail(f"the writer of {state_dir.root} did not answer", EXIT_NO_ANSWER)
    except CorralError as exc:
        return _fail(str(exc).splitlines()[0])
    finally:
        writer.close()
        ctx.destroy(linger=0)
    return code


def registry_apply(state_dir: StateDir, op_name: str, args_json: str) -> int:
    from actors.agent import catalog
    from actors.kernel.ops import Rejected
    from actors.registries import ops

    catalog.install()  # the registry ops, and the ops an installed pipeline may name
    if op_name not in ops.REGISTRY_OF:
        return _fail(f"{op_name} is not a registry op ({', '.join(ops.REGISTRY_OF)})",
                     EXIT_USAGE)
    try:
        args = json.loads(args_json)
    except ValueError as exc:
        return _fail(f"--args is not JSON: {exc}", EXIT_USAGE)
    if not isinstance(args, dict):
        return _fail("--args must be a JSON object", EXIT_USAGE)
    parsed = catalog.parse_action({"op": op_name, **args})
    if isinstance(parsed, Rejected):
        return _fail(f"{op_name}: {'; '.join(parsed.errors)}", EXIT_USAGE)

    def read_pipeline(path: str) -> tuple[str, str]:
        file = Path(path).resolve()
        return file.read_text(encoding="utf-8"), str(file)

    def act(writer: WriterClient) -> int:
        try:
            result = ops.apply(parsed, state_dir, writer, actor="operator",
                               key=f"cfg:operator:{secrets.token_hex(8)}",
                               read_pipeline=read_pipeline)
        except OSError as exc:
            return _fail(f"{op_name}: {exc.strerror}: {exc.filename}")
        print(json.dumps(result, sort_keys=True))
        return EXIT_OK

    return _with_operator(state_dir, act)


def registry_restore(state_dir: StateDir, seq: int) -> int:
    from actors.registries import store

    def act(writer: WriterClient) -> int:
        written = store.restore_registries(state_dir, writer, seq)
        for gen in written:
            print(f"supervisor: {gen.registry} restored to seq {seq} as generation {gen.seq}")
        if not written:
            print(f"supervisor: every registry already holds its content at seq {seq}")
        return EXIT_OK

    return _with_operator(state_dir, act)


def registry_show(state_dir: StateDir, registry: str | None, seq: int | None) -> int:
    from actors.registries import schemas, store

    try:
        shown = {}
        for name in [registry] if registry else list(schemas.REGISTRIES):
            gen = store.at(state_dir, name, seq)
            shown[name] = {"generation_seq": gen.seq, "entries": gen.entries if registry
                           else gen.names()}
    except store.RegistryError as exc:
        return _fail(str(exc))
    print(json.dumps(shown, indent=2, sort_keys=True))
    return EXIT_OK
