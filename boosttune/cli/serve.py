"""`boosttune serve BUNDLE`: an OpenAI-compatible HTTP server over a bundle's engine."""

from __future__ import annotations

import argparse
import math

from boosttune.cli.flags import (
    COMPILE_HELP,
    DTYPE_HELP,
    QUANTIZE_HELP,
    add_device_arg,
    add_recost_arg,
    add_stack_ssms_arg,
    wants_recost,
)
from boosttune.http.timeouts import ConnectionTimeouts
from boosttune.serving.quantize import SCHEMES


def _whole(text: str, unit: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number{unit}, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole(text, " of bytes")


def _count(text: str) -> int:
    return _whole(text, "")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text}")
    return value


def _model_name(text: str) -> str:
    from boosttune.http.protocol import is_unicode

    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (omit it to use the bundle's directory name)")
    if not is_unicode(text):
        # every response echoes the name, and UTF-8 JSON cannot hold a lone surrogate (/v1/models gave a 500)
        raise argparse.ArgumentTypeError(f"{text!r} holds a lone UTF-16 surrogate or bytes that are not UTF-8: "
                                         "name the model in Unicode text")
    return text


def add_commands(sub) -> dict:
    """Add the serve subcommand; returns its handler by name."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("bundle", metavar="BUNDLE", help="a bundle written by `boosttune export`")
    s.add_argument("--llm", default=None, metavar="PATH",
                   help="where the LLM is, overriding the bundle's reference (its hash is still checked)")
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--dtype", default="fp32", help=f"{DTYPE_HELP}, for the LLM, and the SSMs unless --ssm-dtype")
    s.add_argument("--ssm-dtype", default=None, help="dtype of the SSMs (default: --dtype)")
    add_device_arg(s)
    s.add_argument("--model-name", default=None, type=_model_name,
                   help="model id clients send (default: the bundle directory's name)")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait for the engine (then 503)")
    s.add_argument("--max-request-bytes", "--max-body-bytes", dest="max_request_bytes", type=_positive_int,
                   default=1 << 20, metavar="N",
                   help="larger request bodies get 413, before they are read (default 1 MiB)")
    t = ConnectionTimeouts()  # the defaults, in one place
    s.add_argument("--timeout-keep-alive", type=_seconds, default=t.keep_alive, metavar="S",
                   help=f"close a connection idle this long, new or between requests (default {t.keep_alive:g})")
    s.add_argument("--header-timeout", type=_seconds, default=t.header, metavar="S",
                   help=f"408 and close when a request's headers take longer to arrive (default {t.header:g})")
    s.add_argument("--body-timeout", type=_seconds, default=t.body, metavar="S",
                   help="408 and close when a request's body takes longer to arrive after its headers, e.g. "
                        f"one shorter than its Content-Length (default {t.body:g})")
    s.add_argument("--send-timeout", type=_seconds, default=t.send, metavar="S",
                   help="disconnect (and cancel the request of) a client that reads none of its answer for "
                        f"this long (default {t.send:g})")
    s.add_argument("--default-max-tokens", type=int, default=256, help="chat answer length when max_tokens is absent")
    s.add_argument("--threads", type=int, default=None,
                   help="torch threads of the engine (default: torch's; 1 is best on a CPU shared with other jobs)")
    s.add_argument("--max-batch", type=_count, default=16, metavar="N",
                   help="requests decoded at once, all their token trees verified in one forward per step "
                        "(default 16; 1: one request at a time)")
    s.add_argument("--max-batch-tokens", type=_count, default=64, metavar="N",
                   help="tokens one batched step may verify in all; trees are cut to fit (default 64, at least "
                        "--max-batch)")
    s.add_argument("--draft-max-batch", type=int, default=None, metavar="N",
                   help="requests draft token trees only while at most N decode at once; larger batches take "
                        "plain steps, which cost less per token there (default 2; 0: never draft)")
    s.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    s.add_argument("--quantize", choices=SCHEMES, default=None, help=QUANTIZE_HELP)
    add_recost_arg(s)
    add_stack_ssms_arg(s)
    s.add_argument("--no-scheduler", action="store_true",
                   help="ignore the bundle's learned scheduler: every request drafts with all SSMs "
                        "(and prompt lookup if the bundle was exported with --prompt-lookup)")
    s.add_argument("--no-phrases", action="store_true",
                   help="prompt lookup drafts without the bundle's phrase table (serving/phrases.py)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return {"serve": cmd_serve}


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from boosttune.http.server import ServerConfig, run_server
    from boosttune.serving.bundle import load_bundle

    # The engine runs on its worker thread. If this (main) thread ran a parallel region first, OpenMP
    # (libgomp) keeps this thread's team alive beside the worker's, and with more OpenMP threads than
    # cores it stops spinning between regions: measured on 2 cores (AVX512-bf16 EPYC), a packed bf16
    # product of 16 x 576 x 1536 took 170-200 us on the worker thread against 95-110 us on the main
    # thread (CPU time over wall time 1.3 against 2.0), and the batched server's LLM forward 87 ms
    # against 54. So this thread computes single-threaded (loading the bundle) and the worker takes
    # the threads.
    engine_threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(1)

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    timeouts = ConnectionTimeouts(keep_alive=args.timeout_keep_alive, header=args.header_timeout,
                                  body=args.body_timeout, send=args.send_timeout)
    config = ServerConfig(model_name=args.model_name, max_queue=args.max_queue,
                          max_request_bytes=args.max_request_bytes, default_max_tokens=args.default_max_tokens,
                          torch_threads=engine_threads, use_scheduler=not args.no_scheduler, timeouts=timeouts,
                          phrases=not args.no_phrases,
                          max_batch=args.max_batch, max_batch_tokens=args.max_batch_tokens, compile=args.compile,
                          quantize=args.quantize, recost=wants_recost(args), stack_ssms=args.stack_ssms,
                          **({} if args.draft_max_batch is None else {"draft_max_batch": args.draft_max_batch}))
    bundle = load_bundle(args.bundle, llm=args.llm, dtype=args.dtype, ssm_dtype=args.ssm_dtype, device=args.device)
    run_server(bundle, config, host=args.host, port=args.port, log_level=args.log_level)
    return 0
