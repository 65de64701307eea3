"""The `evenflow` command: `up` (the local mesh), `generate` (offline), `bench` and
`bus-secrets` (NATS users per service role, for deployments)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from evenflow import __version__
from evenflow.engine.config.fields import add_flags, flag_values
from evenflow.engine.config.settings import INT4_GROUP_SIZES, QUANT_METHODS, EngineConfig
from evenflow.models.gguf_export import TYPES as GGUF_TYPES
from evenflow.services.config import MeshConfig


def _generate(args: argparse.Namespace) -> int:
    from evenflow import LLM, SamplingParams
    from evenflow.engine.config.settings import ModelLoadError
    from evenflow.proto.grammar import guide_grammar
    from evenflow.proto.tokenizer import TokenizerError

    try:
        guide = None
        if args.json_schema is not None:
            guide = guide_grammar("json_schema", json.loads(args.json_schema))
        elif args.regex is not None:
            guide = guide_grammar("regex", args.regex)
        elif args.choice:
            guide = guide_grammar("choice", args.choice)
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens, stop=args.stop or (), ignore_eos=args.ignore_eos,
            guide=guide)
        llm = LLM(**flag_values(args, args.setting_flags))
        if args.chat:
            outputs = [llm.chat([{"role": "user", "content": p}], params) for p in args.prompts]
        else:
            outputs = llm.generate(args.prompts, params)
    except (ValueError, ModelLoadError, TokenizerError) as exc:  # (a bad schema included)
        print(f"evenflow generate: error: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs, strict=True):
        if len(args.prompts) > 1 or args.verbose:
            print(f"# prompt: {prompt!r}  ({len(out.prompt_token_ids)} tokens, "
                  f"{len(out.token_ids)} generated, finish: {out.finish_reason})")
        print(out.text)
    return 0


def _preflight(config: Any) -> str | None:
    """What would make `evenflow up` fail at once, said in one line before anything starts:
    a model that does not resolve, a port in use, a missing server binary."""
    import socket

    from evenflow import models
    from evenflow.services.launcher import LaunchError, find_binary

    try:
        model_dir = models.resolve_model(config.model)
    except ValueError as exc:  # a GGUF file that cannot be served
        return str(exc)
    if model_dir is None or not (model_dir / "config.json").is_file():
        return (f"model {config.model!r} is neither a built-in model "
                f"({models.DEFAULT_MODEL}) nor a checkpoint directory with a config.json")
    if config.port:
        with socket.socket() as sock:
            # as the servers bind it: a port left in TIME_WAIT by a previous mesh is free
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((config.host, config.port))
            except OSError as exc:
                return (f"cannot listen on {config.host}:{config.port} ({exc.strerror}); is "
                        "another server running there? choose another with --port")
    try:
        if not config.nats_url:
            find_binary("nats-server")
        if not config.redis_url:
            find_binary("redis-server")
    except LaunchError as exc:
        return str(exc)
    return None


def _mesh_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The MeshConfig settings the flags of `up` / `serve` give (each flag's dest is its
    setting's name: engine/config/fields.py add_flags)."""
    return flag_values(args, args.setting_flags)


def _up(args: argparse.Namespace) -> int:
    import signal
    import time

    from evenflow.services.config import ConfigError, env_help, load_mesh_config
    from evenflow.services.launcher import ROLES, LaunchError, LocalMesh

    if args.help_env:
        print(env_help())
        return 0
    try:
        config = load_mesh_config(_mesh_settings(args))
    except ConfigError as exc:
        print(f"evenflow up: error: {exc}", file=sys.stderr)
        return 2
    problem = _preflight(config)
    if problem:
        print(f"evenflow up: error: {problem}", file=sys.stderr)
        return 2

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    # (the services run in sessions of their own: a terminal's Ctrl-C or hang-up reaches this
    # process alone, which stops them in order: see LocalMesh.stop)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, interrupt)
    roles = tuple(r.strip() for r in getattr(args, "roles", "").split(",") if r.strip())
    unknown = sorted(set(roles) - set(ROLES))
    if unknown or (roles and args.ray):
        print(f"evenflow serve: error: {'roles are ' + ', '.join(ROLES) if unknown else '--ray'}"
              f"{' (not ' + ', '.join(unknown) + ')' if unknown else ' runs whole meshes'}",
              file=sys.stderr)
        return 2
    try:
        kernels = _first_build(config, args)
    except KeyboardInterrupt:
        print("evenflow up: stopped before starting (the kernels build again next time)",
              file=sys.stderr, flush=True)
        return 0
    if args.ray:
        from evenflow.rayserve.local import LocalRayMesh

        mesh: LocalMesh | LocalRayMesh = LocalRayMesh(config, getattr(args, "ray_address",
                                                                       None))
    else:
        mesh = LocalMesh(config, roles=roles, first_index=getattr(args, "index", 0),
                         serve_rendezvous=getattr(args, "ep_rendezvous_serve", False))
    try:
        if isinstance(mesh, LocalMesh):
            # torch's kernels serve until the build is done; each worker then switches
            mesh.start(env={"EVENFLOW_NATIVE_BUILD": "background"} if kernels else None)
        else:
            mesh.start()
        _announce(mesh, roles, args.ray)
        return _supervise(mesh, kernels)
    except LaunchError as exc:
        print(f"evenflow up: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("evenflow up: stopping ...", file=sys.stderr, flush=True)
        return 0
    finally:
        stopping = time.monotonic()
        if kernels is not None:
            kernels.stop()
        stopped = mesh.stop()
        print(f"evenflow up: stopped {stopped} services in {time.monotonic() - stopping:.1f} s",
              file=sys.stderr, flush=True)


def _first_build(config: Any, args: argparse.Namespace) -> Any:
    """The native kernels' first build on this machine, when due: started in the background
    (the KernelBuild to poll), or waited for (None) in the modes whose workers must run the
    same kernels from the first step. Ctrl-C while waiting stops it (KeyboardInterrupt)."""
    from evenflow.engine.kernels import first_build

    if config.engine != "torch" or not first_build.due():
        return None
    kernels = first_build.KernelBuild(lambda line: print(f"evenflow up: {line}", flush=True),
                                      then="; each worker switches to them when idle").start()
    if config.deterministic or config.tensor_parallel_size > 1 or \
            config.expert_parallel_size > 1 or args.ray:
        try:
            kernels.wait()
        except KeyboardInterrupt:
            kernels.stop()
            raise
        return None
    return kernels


def _announce(mesh: Any, roles: tuple[str, ...], ray: bool) -> None:
    """What is served where, the metrics, the doctor's command and a first request."""
    from evenflow.services.config import redact
    from evenflow.services.launcher import LocalMesh

    c = mesh.config
    if roles:
        gateway = f" at {mesh.url}" if "gateway" in roles else ""
        print(f"evenflow is serving {c.model_name}{gateway}: this host runs "
              f"{', '.join(roles)} (NATS {redact(c.nats_url)}, Redis "
              f"{redact(c.redis_url)})", flush=True)
    else:
        gateways = "gateway" if c.num_gateways == 1 else f"{c.num_gateways} gateways"
        where = "on Ray Serve" if ray else f"({gateways}, {c.num_prefill} prefill, " \
            f"{c.num_decode} decode; NATS {redact(c.nats_url)}, Redis {redact(c.redis_url)})"
        print(f"evenflow is serving {c.model_name} at {mesh.url}  {where}", flush=True)
    if isinstance(mesh, LocalMesh):
        print("metrics: " + ", ".join(f"{name} {url}" for name, url in
                                      mesh.metrics_urls().items()), flush=True)
        admin = mesh.credentials.get(("admin", ""))
        if admin and (not roles or "gateway" in roles):
            print(f"operators: evenflow doctor --url {mesh.url} --nats {c.nats_url} "
                  f"--nats-credentials {admin}  (the admin user's credentials, mode 0600)",
                  flush=True)
    if not roles or "gateway" in roles:
        print(f"try: curl -N {mesh.url}/v1/chat/completions -H 'Content-Type: "
              "application/json' "
              f"-d '{{\"model\": \"{c.model_name}\", \"stream\": true, \"messages\": "
              f"[{{\"role\": \"user\", \"content\": \"count from 5\"}}]}}'",
              flush=True)


def _supervise(mesh: Any, kernels: Any) -> int:
    """Restart whatever dies, give up on what keeps dying (exit status 1), until Ctrl-C;
    meanwhile report the kernels' build (KernelBuild.poll) until it is done."""
    import time

    from evenflow.services.supervisor import GaveUp

    while True:
        if kernels is not None and kernels.poll():
            kernels = None
        try:
            mesh.supervise(report=lambda m: print(f"evenflow up: {m}", file=sys.stderr,
                                                  flush=True))
        except GaveUp as exc:
            print(f"evenflow up: {exc}; stopping", file=sys.stderr)
            return 1
        time.sleep(0.5)


BENCHMARKS = {  # `evenflow bench NAME` -> its module (each has main(argv))
    **{name: f"evenflow.bench.offline.{name}_bench"
       for name in ("engine", "quant", "tiers", "sampling", "kernels", "load", "spec",
                     "lora")},
    **{name: f"evenflow.bench.mesh.{name}_bench"
       for name in ("serve", "routing", "wire", "soak", "frontend", "hosts", "admission",
                    "planner", "chaos")},
    **{name: f"evenflow.bench.experts.{name}_bench" for name in ("eplb", "comm", "ep")},
}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.what])
    return int(module.main(args.rest))


def _dev(args: argparse.Namespace) -> int:
    from evenflow.dev import hosts

    return hosts.main(args.rest)


def _profile(args: argparse.Namespace) -> int:
    from evenflow.bench.offline import profile_bench

    return int(profile_bench.main(args.rest))


def _quantize(args: argparse.Namespace) -> int:
    from evenflow import models
    from evenflow.engine.config.settings import ModelLoadError
    from evenflow.engine.quant.stacks import QuantConfig
    from evenflow.engine.weights.compressed_tensors import write_compressed_tensors
    from evenflow.engine.weights.gptq import write_gptq

    try:
        source = models.resolve_model(args.model)
    except ValueError as exc:  # a Hugging Face id that cannot be had (HubError), a bad GGUF
        print(f"evenflow quantize: error: {exc}", file=sys.stderr)
        return 2
    if source is None:
        print(f"evenflow quantize: error: no model {args.model!r}", file=sys.stderr)
        return 2
    fmt = args.format or ("compressed-tensors" if args.quantization == "w8a8" else "gptq")
    if fmt == "gptq" and args.quantization == "w8a8":
        print("evenflow quantize: error: GPTQ has no w8a8 (int8 activations): use "
              "--format compressed-tensors", file=sys.stderr)
        return 2
    write = write_gptq if fmt == "gptq" else write_compressed_tensors
    try:
        out = write(source, args.out, QuantConfig(args.quantization, args.group_size,
                                                  args.symmetric))
    except (ValueError, ModelLoadError, OSError) as exc:
        print(f"evenflow quantize: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a {fmt} checkpoint ({args.quantization}) to {out}; serve it with "
          f"`evenflow up --model {out}`")
    return 0


def _gguf_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from evenflow import models
    from evenflow.models.gguf_export import export_gguf

    try:
        source = models.resolve_model(args.model)
    except ValueError as exc:  # a Hugging Face id that cannot be had (HubError), a bad GGUF
        print(f"evenflow gguf export: error: {exc}", file=sys.stderr)
        return 2
    if source is None:
        print(f"evenflow gguf export: error: no model {args.model!r}", file=sys.stderr)
        return 2
    try:
        out = export_gguf(source, Path(args.out), args.type)
    except (ValueError, KeyError, OSError) as exc:
        print(f"evenflow gguf export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.type}); serve it with `evenflow up --model {out}`")
    return 0


def _bus_secrets(args: argparse.Namespace) -> int:
    from pathlib import Path

    from evenflow.services.nats_auth import write_role_secrets

    paths = write_role_secrets(Path(args.directory), args.port, args.host)
    print(f"wrote {Path(args.directory) / 'nats-server.conf'} (start nats-server with -c) and "
          f"credentials (mode 0600) for: {', '.join(paths)}")
    print("give each service its role's file: EVENFLOW_NATS_CREDENTIALS_FILE=<dir>/nats-<role>"
          ".creds")
    return 0


def _mesh_arguments(up: argparse.ArgumentParser, command: str) -> None:
    """`evenflow up`'s and `evenflow serve`'s options: the settings' flags (declared with the
    settings, engine/config/fields.py) and the commands' own."""
    up.add_argument("--ray", action="store_true",
                    help="run the services as Ray Serve applications on a local Ray")
    up.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                    help="with --ray: deploy on this Ray cluster (its nodes on several hosts) "
                         "instead of a local Ray; needs --nats-url and --redis-url")
    up.add_argument("--help-env", action="store_true",
                    help="list every EVENFLOW_* setting and engine switch with its default")
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    mesh_group = up.add_argument_group("mesh (each also an EVENFLOW_* variable: `--help-env`)")
    engine_group = up.add_argument_group(
        "engine (each also an EVENFLOW_* variable; unset: the engine's default)")
    names = add_flags(mesh_group, MeshConfig, command, skip=engine)
    names += add_flags(engine_group, MeshConfig, command, only=engine)
    up.set_defaults(setting_flags=names)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evenflow", description=__doc__)
    parser.add_argument("--version", action="version", version=f"evenflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_mesh_commands(sub)
    _add_file_commands(sub)
    _add_tools(sub)
    return parser


def _add_generate(sub: Any) -> None:
    """`evenflow generate`: the offline engine."""
    gen = sub.add_parser("generate", help="generate text offline with the engine")
    gen.add_argument("prompts", nargs="+", help="prompt text(s); several are batched together")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat turn")
    guided = gen.add_mutually_exclusive_group()
    guided.add_argument("--json-schema", default=None,
                        help="structured output: the output is JSON matching this schema (text)")
    guided.add_argument("--regex", default=None, help="structured output: matching this regex")
    guided.add_argument("--choice", action="append", help="structured output: one of these "
                        "strings (repeatable)")
    gen.set_defaults(setting_flags=add_flags(gen, EngineConfig, "generate"))
    gen.add_argument("-v", "--verbose", action="store_true")
    gen.set_defaults(func=_generate)


def _add_mesh_commands(sub: Any) -> None:
    """`evenflow up` (the local mesh) and `serve` (one host's share of a mesh)."""
    up = sub.add_parser("up", help="run the local mesh: NATS, Redis, gateway, workers")
    _mesh_arguments(up, "up")
    up.set_defaults(func=_up)
    serve = sub.add_parser(
        "serve", help="run one host's share of a mesh spanning several hosts",
        description="Start only --roles here, against the mesh's NATS (one or more servers, "
                    "comma-separated: a NATS cluster) and Redis; number this host's workers "
                    "from --index so every worker id is unique in the mesh. The gateway "
                    "listens on --host (an address of this host other hosts and clients reach).")
    _mesh_arguments(serve, "serve")
    serve.add_argument("--roles", required=True,
                       help="comma-separated: gateway, prefill, decode, kv_index, balancer")
    serve.add_argument("--index", type=int, default=0,
                       help="first worker number on this host (p<index>, d<index>, ...)")
    serve.add_argument("--ep-rendezvous-serve", action="store_true",
                       help="serve the rendezvous store here (one host of the mesh does)")
    serve.set_defaults(func=_up)


def _add_file_commands(sub: Any) -> None:
    """Commands that write files: `quantize`, `gguf export`, `bus-secrets`."""
    quant = sub.add_parser("quantize", help="write a quantized copy of a checkpoint (GPTQ or "
                                            "compressed-tensors format)")
    quant.add_argument("model", help="built-in model name or checkpoint dir (bf16/fp32)")
    quant.add_argument("out", help="directory for the quantized checkpoint")
    quant.add_argument("--quantization", default="int4", choices=list(QUANT_METHODS))
    quant.add_argument("--format", default=None, choices=["gptq", "compressed-tensors"],
                       help="default: compressed-tensors for w8a8 (as vLLM serves W8A8), GPTQ "
                            "for int8 and int4")
    quant.add_argument("--group-size", type=int, default=64, choices=list(INT4_GROUP_SIZES))
    quant.add_argument("--symmetric", action="store_true", help="int4 without zero points")
    quant.set_defaults(func=_quantize)

    gguf = sub.add_parser("gguf", help="GGUF files: `evenflow gguf export MODEL OUT --type q4_k_m`")
    gguf_sub = gguf.add_subparsers(dest="gguf_command", required=True)
    export = gguf_sub.add_parser("export", help="write a checkpoint as a GGUF file (llama.cpp's "
                                                "layout, its tokenizer and chat template)")
    export.add_argument("model", help="built-in model name or checkpoint dir")
    export.add_argument("out", help="the .gguf file to write")
    export.add_argument("--type", default="bf16", choices=list(GGUF_TYPES),
                        help="the weight matrices' type (q4_k_m and q5_k_m: llama-quantize's "
                             "mixes; rows not in whole blocks fall back as llama-quantize does)")
    export.set_defaults(func=_gguf_export)

    secrets = sub.add_parser(
        "bus-secrets", help="write a nats-server config with a user per service role, and each "
                            "role's credentials file (for compose, KubeRay, your own NATS)")
    secrets.add_argument("directory", help="where to write them (created with mode 0700)")
    secrets.add_argument("--port", type=int, default=4222, help="nats-server's port")
    secrets.add_argument("--host", default="0.0.0.0", help="nats-server's listen address")
    secrets.set_defaults(func=_bus_secrets)


def _add_tools(sub: Any) -> None:
    """`doctor`, `profile`, `dev` and `bench`: each parses its own options."""
    sub.add_parser("doctor", add_help=False,
                   help="find the straggler on a local mesh: `evenflow doctor --help`")
    prof = sub.add_parser("profile", add_help=False,
                          help="torch.profiler over the offline engine: `evenflow profile --help`")
    prof.add_argument("rest", nargs=argparse.REMAINDER)
    prof.set_defaults(func=_profile)
    sub.add_parser("profile-roles", add_help=False,
                   help="measure what a prefill and a decode worker cost here, for the "
                        "planner: `evenflow profile-roles --help`")
    sub.add_parser("planner", add_help=False,
                   help="run the SLA planner against a running mesh: `evenflow planner --help`")
    dev = sub.add_parser("dev", add_help=False,
                         help="developer tools: `evenflow dev hosts --help` (simulated hosts)")
    dev.add_argument("tool", choices=["hosts"])
    dev.add_argument("rest", nargs=argparse.REMAINDER)
    dev.set_defaults(func=_dev)
    bench = sub.add_parser("bench", help="run a benchmark: `evenflow bench engine --help`")
    bench.add_argument("what", choices=list(BENCHMARKS))
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["profile"]:  # its options are profile_bench's own (argparse's REMAINDER
        from evenflow.bench.offline import profile_bench  # drops leading options)

        return int(profile_bench.main(argv[1:]))
    if argv[:1] == ["doctor"]:
        from evenflow.ops import doctor

        return int(doctor.main(argv[1:]))
    if argv[:1] == ["profile-roles"]:
        from evenflow.bench.offline import role_profile

        return int(role_profile.main(argv[1:]))
    if argv[:1] == ["planner"]:
        from evenflow.planner.__main__ import main as planner_main

        return planner_main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
