"""The `dflash-trt` command line: thin click commands over the library.

Library errors cross into click exactly once, in `_errors()`: a DFlashError becomes a
ClickException (exit 1); bad flags are click usage errors (exit 2). Each command imports the
library it drives inside its body: those modules import torch (or tritonclient), and
`dflash-trt --help` and a bad flag should answer without paying for that. These are the
package's only function-local imports besides optional dependencies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import click

from dflash_trt import __version__
from dflash_trt.config import preset_names, resolve_config
from dflash_trt.errors import DFlashError


@contextlib.contextmanager
def _errors():
    try:
        yield
    except DFlashError as e:
        raise click.ClickException(str(e)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dflash-trt")
def cli():
    """Lossless DFlash speculative decoding for Qwen, served by Triton.

    \b
    dflash-trt build -o out/demo                 # the embedded demo pair
    dflash-trt run out/demo "Write a haiku." --stats
    dflash-trt build --preset qwen3-8b-b16 -o out/qwen3-8b
    """


@cli.command()
@click.option("--target", metavar="SRC", help="Target checkpoint: local directory or Hugging Face id.")
@click.option("--drafter", metavar="SRC", help="DFlash drafter checkpoint: local directory or Hugging Face id.")
@click.option("--preset", type=click.Choice(preset_names()), help="A build_configs/*.toml preset.")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A TOML file with BuildConfig fields (instead of --preset).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Output directory.")
@click.option("--force", is_flag=True, help="Replace an output directory that an earlier build made "
                                             "(it holds a .dflash-trt-build marker and nothing else).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--device", type=click.Choice(["cpu", "cuda"]))
@click.option("--max-batch-size", type=click.IntRange(min=1))
@click.option("--max-input-len", type=click.IntRange(min=1))
@click.option("--max-output-len", type=click.IntRange(min=1))
@click.option("--block-size", type=click.IntRange(min=0))
@click.option("--draft-window-size", type=click.IntRange(min=0),
              help="The drafter attends to the last N committed tokens only (0, the default: all); "
                   "bounds its cache and draft time on long contexts. At least the block size.")
@click.option("--draft-vocab-size", type=click.IntRange(min=0),
              help="The drafter proposes only the K tokens most frequent in --draft-vocab-corpus (0: all): its "
                   "LM head reads K rows. Output is unchanged (verification sees every token).")
@click.option("--draft-vocab-corpus", metavar="SRC",
              help="A token dataset (train's OUTPUT/data), a JSONL of prompts (or gsm8k, humaneval, mt_bench) "
                   "or a text file.")
@click.option("--prefill-chunk-size", type=click.IntRange(min=0),
              help="Prefill prompts at most N tokens per engine step, between the running requests' steps, so a "
                   "long prompt does not stall them (0, the default: a prompt in one pass).")
@click.option("--verify-width", type=click.Choice(["auto", "full", "adaptive"]),
              help="full: every verify checks the whole block; adaptive: per step, the width that maximises expected "
                   "tokens/s from step times measured at warm-up (CUDA graphs only); auto (the default): adaptive "
                   "where the engine runs CUDA graphs on one rank, else full.")
@click.option("--overlap/--no-overlap", default=None,
              help="Overlap the host's work on the next step with the device's on this one (the default), or run "
                   "the serial loop (a debugging aid, like SGLang's --disable-overlap-schedule).")
@click.option("--tensor-parallel", type=click.IntRange(min=1),
              help="Shard the engine over N GPUs (N processes on the CPU); run and serve start the ranks.")
def build(target, drafter, preset, config_file, output, force, **overrides):
    """Build an engine directory and Triton model repository.

    With no --target/--drafter (and no preset naming them) the embedded demo pair is built.

    \b
    dflash-trt build -o out/demo
    dflash-trt build --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 --device cuda -o out/q8
    """
    from dflash_trt import build as build_lib

    if preset and config_file:
        raise click.UsageError("give --preset or --config, not both")
    with _errors():
        config = resolve_config(preset, config_file, target=target, drafter=drafter, **overrides)
        path = build_lib.run(config, output, force=force)
    click.echo(path)


_DRAFT_WINDOW = click.option("--draft-window-size", type=click.IntRange(min=0),
                             help="Override the build's draft window (0: none; see build --help).")
_TENSOR_PARALLEL = click.option("--tensor-parallel", type=click.IntRange(min=1),
                                help="Override the build's tensor-parallel ranks (see build --help).")


def _sampling_options(command):
    options = [
        click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True),
        click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True),
        click.option("--seed", type=int),
        click.option("--chat/--no-chat", default=True, show_default=True, help="Apply the chat template."),
        click.option("--thinking/--no-thinking", default=False, show_default=True,
                     help="Let the model think first (Qwen3 chat template)."),
        click.option("--stats", is_flag=True, help="Print acceptance length and tokens/s to stderr."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@cli.command()
@click.argument("output_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("prompt")
@click.option("--mode", type=click.Choice(["dflash", "ar"]), default="dflash", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), help="Default: the device the engine was built for.")
@_DRAFT_WINDOW
@_TENSOR_PARALLEL
@_sampling_options
def run(output_dir, prompt, mode, device, draft_window_size, tensor_parallel, max_tokens, temperature, top_k, top_p,
        seed, chat, thinking, stats):
    """Generate in-process from a built engine (no server).

    \b
    dflash-trt run out/demo "Write a quicksort in Python." --stats
    """
    from dflash_trt.loading import load_engine
    from dflash_trt.sampling import SamplingParams

    with _errors():
        loaded = load_engine(output_dir / "engine", device, draft_window_size, tensor_parallel)
        tok = loaded.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], enable_thinking=thinking) if chat else prompt
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                stop_token_ids=tuple(tok.stop_token_ids))
        start = time.perf_counter()
        result = loaded.engine.generate([tok.encode(text)], params, mode=mode)[0]
        elapsed = time.perf_counter() - start
    click.echo(tok.decode(result.token_ids))
    if stats:
        s = result.stats
        tau = f"{s.mean_acceptance_length:.2f}" if mode == "dflash" else "n/a (AR)"
        click.echo(f"[{mode}] {s.output_tokens} tokens in {elapsed:.2f}s = {s.output_tokens / elapsed:.1f} tok/s; "
                   f"mean acceptance length {tau}; verify steps {s.verify_steps}"
                   + (f" of {s.mean_verify_width:.2f} tokens" if s.verify_steps else ""), err=True)


def _ints(ctx, param, value):
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


@cli.command()
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The target checkpoint directory (Hugging Face layout).")
@click.option("--data", "source", required=True, metavar="FILE_OR_DATASET",
              help="Prompts (JSONL with 'prompt', 'messages' or ShareGPT's 'conversations'; or gsm8k, humaneval, "
                   "mt_bench) whose responses the target writes, or a token dataset directory an earlier run wrote "
                   "(OUTPUT/data).")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The drafter directory to write (z-lab layout; also its checkpoint, log and evaluation).")
@click.option("--block-size", type=click.IntRange(min=2), default=16, show_default=True)
@click.option("--extra-block-size", "extra_block_sizes", type=click.IntRange(min=2), multiple=True,
              help="A smaller block size the drafter also learns to serve (each block draws its size among these "
                   "and --block-size); repeat for several. A drafter trained at one size drafts worse at another.")
@click.option("--draft-layers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--target-layer-ids", callback=_ints,
              help="Tapped target layers, e.g. 1,9,17 [default: z-lab's formula].")
@click.option("--mask-token-id", type=click.IntRange(min=0),
              help="[default: the first embedding row the tokenizer does not use]")
@click.option("--sliding-layers", callback=_ints, default="",
              help="Drafter layers with a sliding window, e.g. 0.")
@click.option("--sliding-window", type=click.IntRange(min=1))
@click.option("--intermediate-size", type=click.IntRange(min=1),
              help="The drafter's MLP width [default: the target's].")
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Sequences per step and process.")
@click.option("--max-length", type=click.IntRange(min=2), default=1024, show_default=True)
@click.option("--num-anchors", type=click.IntRange(min=1), default=64, show_default=True, help="Blocks per sequence.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=6e-4, show_default=True)
@click.option("--warmup", type=click.FloatRange(0, 1), default=0.04, show_default=True, help="Share of the steps.")
@click.option("--decay", type=click.FloatRange(min=0, min_open=True),
              help="Gamma of the per-slot loss weights exp(-(j-1)/gamma) [default: 7 at block 16, 4 at 8].")
@click.option("--distill/--no-distill", default=False, show_default=True,
              help="Learn the target's whole next-token distribution at every block row (its KL divergence to the "
                   "drafter's) instead of only the token it wrote; costs vocabulary-sized rows of memory.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--log-every", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--eval-prompts", type=click.IntRange(min=0), default=16, show_default=True,
              help="The data's last sequences, held out of training; their prompts measure real acceptance at the end.")
@click.option("--eval-max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--eval-temperature", type=click.FloatRange(min=0), multiple=True,
              help="Repeat for several [default: 0, greedy].")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Fine-tune this drafter instead of starting from random weights.")
@click.option("--resume", is_flag=True, help="Continue the run whose checkpoint OUTPUT holds.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes (one per GPU; gloo on the CPU), data-parallel. torchrun works too.")
@click.option("--shard-target", is_flag=True,
              help="For a target one device cannot hold: shard its layers over the processes (FSDP) for training, "
                   "and split it over them (tensor parallel) to write the data and evaluate the drafter.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--chat/--no-chat", default=True, show_default=True, help="Prompts through the chat template.")
@click.option("--thinking/--no-thinking", default=False, show_default=True)
@click.option("--response-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="The longest response the target writes per prompt.")
@click.option("--response-temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--num-prompts", type=click.IntRange(min=1), help="Use at most this many prompts.")
@click.option("--generate-batch", type=click.IntRange(min=1), default=32, show_default=True,
              help="Responses the target writes at once.")
def train(target, source, output, block_size, extra_block_sizes, draft_layers, target_layer_ids, mask_token_id,
          sliding_layers, sliding_window, intermediate_size, steps, batch_size, max_length, num_anchors, lr, warmup,
          decay, distill, checkpoint_every, log_every, eval_prompts, eval_max_tokens, eval_temperature, init_from,
          resume, nproc, shard_target, device, seed, chat, thinking, response_tokens, response_temperature, num_prompts,
          generate_batch):
    """Train a DFlash drafter for a target on responses the target writes itself.

    \b
    dflash-trt train --target models/Qwen3-4B --data prompts.jsonl -o drafters/q4 --steps 4000
    dflash-trt train --target out/t --data out/d/data -o out/d --resume   # after a stop or a kill
    dflash-trt train --target models/Qwen3.6-35B-A3B --data prompts.jsonl -o drafters/q36 --nproc 8 --shard-target
    """
    from dflash_trt.training.drafter_files import DrafterShape
    from dflash_trt.training.trainer import DataConfig, TrainConfig, train_processes
    from dflash_trt.training.trainer import train as train_drafter

    kwargs = dict(
        target_dir=target, source=source, out_dir=output, init_from=init_from, resume=resume, device=device,
        temperatures=eval_temperature or (0.0,), shard_target=shard_target, progress=_progress,
        shape=DrafterShape(block_size, draft_layers, target_layer_ids, mask_token_id, sliding_window, sliding_layers,
                           intermediate_size),
        cfg=TrainConfig(steps=steps, batch_size=batch_size, max_length=max_length, num_anchors=num_anchors, lr=lr,
                        warmup=warmup, decay=decay, block_sizes=tuple(sorted(set(extra_block_sizes))),
                        distill=distill, checkpoint_every=checkpoint_every, log_every=log_every,
                        eval_prompts=eval_prompts, eval_max_tokens=eval_max_tokens, seed=seed),
        data_cfg=DataConfig(chat=chat, thinking=thinking, max_tokens=response_tokens,
                            temperature=response_temperature, limit=num_prompts, generate_batch=generate_batch))
    with _errors():
        report = train_processes(nproc, **kwargs) if nproc > 1 else train_drafter(**kwargs)
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 speaks for the run
        return
    for measured in [report, *(v for k, v in report.items() if k.startswith("block_") and isinstance(v, dict))]:
        for key, value in measured.items():
            if key.startswith("temperature_"):
                click.echo(f"held-out prompts ({report['prompts']}), block {measured['block_size']}, "
                           f"{key.replace('_', ' ')}: mean acceptance length {value['tau']:.2f} over "
                           f"{value['verify_steps']} verify steps; histogram {value['acceptance_histogram']}")
    click.echo(f"drafter: {output}")


def _progress(message: str) -> None:
    click.echo(message, err=True)


@cli.command()
@click.argument("output_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("tritonserver_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- TRITONSERVER_ARGS]...")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address every endpoint binds (HTTP, gRPC, metrics, OpenAI; 0.0.0.0: every interface).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds the requests in flight get to finish on Ctrl-C or SIGTERM; then they get an error.")
@click.option("--openai-port", type=click.IntRange(0, 65535), default=9000, show_default=True,
              help="Port of the OpenAI-compatible API (/v1/chat/completions, ...); 0: none.")
@click.option("--api-key", envvar="DFLASH_TRT_API_KEY", help="Key the OpenAI API asks for (Bearer); default: none.")
@click.option("--served-model-name", help="Model name the OpenAI API lists (default: the target's directory name).")
@click.option("--allow-admin-api", is_flag=True,
              help="Open Triton's model-repository, shared-memory, logging and trace APIs to every client "
                   "(by default they need the key serve writes to a file).")
@click.option("--tritonserver", "tritonserver", type=click.Path(path_type=Path), envvar="DFLASH_TRT_TRITONSERVER",
              help="tritonserver binary (default: PATH, then the one bundled in nvidia-pytriton).")
@_DRAFT_WINDOW
@_TENSOR_PARALLEL
def serve(output_dir, tritonserver_args, http_port, grpc_port, metrics_port, host, drain_timeout, openai_port,
          api_key, served_model_name, allow_admin_api, tritonserver, draft_window_size, tensor_parallel):
    """Serve a built output directory with a real tritonserver until Ctrl-C or SIGTERM.

    Exits non-zero when tritonserver or one of its model processes dies (having stopped the
    rest), so that a supervisor restarts it, and when a shutdown was not clean.
    Arguments after `--` go to tritonserver as they are, after ours (a later flag wins).

    \b
    dflash-trt serve out/demo
    dflash-trt serve out/demo -- --log-verbose=1 --pinned-memory-pool-byte-size=0
    dflash-trt generate "Write a haiku." --stream --stats
    """
    from dflash_trt.serving.openai_api import start_api
    from dflash_trt.serving.repository import DRAFT_WINDOW_ENV, TENSOR_PARALLEL_ENV
    from dflash_trt.serving.server import (
        ADMIN_APIS,
        ADMIN_HEADER,
        TritonServer,
        check_ports_free,
        endpoints_at,
        write_admin_key,
    )

    def ignore_signals():
        # A Ctrl-C / SIGTERM must not interrupt a stop and orphan the server; stop() is
        # bounded (the drain, then SIGKILL of the whole group).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def shutdown(signum, frame):
        ignore_signals()
        raise KeyboardInterrupt

    admin_key, key_file = (None, None) if allow_admin_api else write_admin_key()
    server = TritonServer(output_dir / "model_repository", http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, host=host, tritonserver=tritonserver,
                          extra_args=tritonserver_args, admin_key=admin_key, drain_timeout=drain_timeout,
                          env={name: str(value) for name, value in ((DRAFT_WINDOW_ENV, draft_window_size),
                                                                    (TENSOR_PARALLEL_ENV, tensor_parallel))
                               if value is not None})
    # Before start(): a stop while the models load (minutes, for a real model) must clean up too.
    signal.signal(signal.SIGINT, shutdown)
    signal.signal(signal.SIGTERM, shutdown)
    api = None
    try:
        with _errors():
            if openai_port:
                check_ports_free(host, (*server.ports, openai_port))
            server.start()
            try:
                api = start_api(output_dir / "engine", server.endpoints.grpc, host, openai_port, api_key,
                                served_model_name) if openai_port else None
            except BaseException:
                server.stop(drain_timeout=0)
                raise
        bound = endpoints_at(host, server.ports)
        click.echo(f"HTTP    {bound.http}\nGRPC    {bound.grpc}\nmetrics {bound.metrics}")
        if api is not None:
            click.echo(f"OpenAI  {api.url}")
        click.echo(f"server log: {server.log_path}", err=True)
        if key_file is not None:
            click.echo(f"admin APIs ({ADMIN_APIS}) need the header {ADMIN_HEADER} "
                       f"(gRPC: triton-grpc-protocol-{ADMIN_HEADER}), key in {key_file}", err=True)
        reason = server.watch()
        ignore_signals()
        # A dead stub leaves a server that reports ready but cannot answer: stop all of it.
        if api is not None:
            api.release_streams()
        code = server.stop(drain_timeout=0)
        raise click.ClickException(f"{reason}; stopped the server (tritonserver exit code {code}); "
                                   f"see {server.log_path}")
    except KeyboardInterrupt:
        if server.pid is None:
            return
        click.echo(f"stopping tritonserver (requests in flight get {drain_timeout:g} s)", err=True)
        if api is not None:
            api.release_streams()  # an open gRPC stream keeps tritonserver from exiting
        code = server.stop()  # start() may have stopped it already: then this only returns its code
        if code != 0 and server.endpoints is not None:  # before ready, Triton can only be killed
            raise click.ClickException(f"tritonserver did not shut down cleanly (exit code {code}); "
                                       f"see {server.log_path}") from None
    finally:
        if api is not None:
            api.stop()  # after the server's drain: the API's own streams end with it
        if key_file is not None:
            key_file.unlink(missing_ok=True)


@cli.command()
@click.argument("prompt")
@click.option("--url", help="Server address host:port [default: localhost:8001 for grpc, localhost:8000 for http].")
@click.option("--protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True)
@click.option("--stream", is_flag=True, help="Print text as it arrives (gRPC).")
@_sampling_options
def generate(prompt, url, protocol, stream, max_tokens, temperature, top_k, top_p, seed, chat, thinking, stats):
    """Send one prompt to a running server and print the answer.

    \b
    dflash-trt generate "Write a quicksort in Python." --stream --stats
    """
    from dflash_trt.serving import client

    url = url or ("localhost:8000" if protocol == "http" else "localhost:8001")
    completion = client.Completion()
    start = time.perf_counter()
    with _errors():
        for chunk in client.generate(url, prompt, protocol=protocol, stream=stream, completion=completion,
                                     max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                     seed=seed, chat=chat, thinking=thinking, stats=stats):
            click.echo(chunk, nl=False)
    click.echo()
    if stats:
        elapsed = time.perf_counter() - start
        m = completion.metrics
        tokens = m.get("num_output_tokens", 0)
        click.echo(f"{tokens} tokens in {elapsed:.2f}s = {tokens / elapsed:.1f} tok/s (client side); "
                   f"mean acceptance length {m.get('mean_acceptance_length', 0):.2f}; "
                   f"acceptance rate {m.get('acceptance_rate', 0):.3f} "
                   f"({m.get('total_accepted_draft_tokens', 0)}/{m.get('total_draft_tokens', 0)} drafts accepted)",
                   err=True)


class _LazyChoice(click.Choice):
    """A click.Choice whose names are loaded on first use, so `dflash-trt --help` stays instant."""

    def __init__(self, load_names):
        self._load_names, self._names = load_names, None
        self.case_sensitive = True

    @property
    def choices(self):
        if self._names is None:
            self._names = tuple(self._load_names())
        return self._names


def _random_weights_presets() -> list[str]:
    from dflash_trt.benchmark.random_weights import PRESETS  # imports torch: only when the option is used or shown

    return list(PRESETS)


def _bench_engine(output_dir, random_weights, device, draft_window, tensor_parallel, max_seq_len):
    """The in-process engine of `bench`: a built OUTPUT_DIR, random weights, or None (--url only)."""
    if output_dir is not None:
        from dflash_trt.loading import load_engine

        return load_engine(output_dir / "engine", device, draft_window, tensor_parallel)
    if tensor_parallel not in (None, 1):
        raise click.UsageError("--tensor-parallel needs a built OUTPUT_DIR")
    if random_weights is not None:
        from dflash_trt.benchmark.random_weights import random_engine

        # One slot is enough: run_bench makes an engine per concurrency from the shared models.
        return random_engine(random_weights, device=device or "cuda", max_batch_size=1, draft_window=draft_window or 0,
                             max_seq_len=max(max_seq_len or 0, 4096))
    return None


@cli.command()
@click.argument("output_dir", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--random-weights", type=_LazyChoice(_random_weights_presets),
              help="Real-shape random weights made on --device (default cuda) instead of OUTPUT_DIR; "
                   "pair with --oracle-tau (random drafters accept almost nothing).")
@click.option("--url", "urls", multiple=True,
              help="Also measure through a running server: Triton's gRPC address host:port, or the OpenAI API's "
                   "http://host:port; repeatable. Token counts are the server's (end token left out).")
@click.option("--compare-transformers", is_flag=True, help="Add a transformers generate row at concurrency 1.")
@click.option("--dataset", "datasets", multiple=True, default=["gsm8k"], show_default=True, metavar="NAME|PATH",
              help="gsm8k, humaneval, mt_bench, or a JSONL file with a 'prompt' field; repeatable.")
@click.option("--concurrency", default="1,8,16,32", show_default=True, help="Comma-separated concurrencies.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--oracle-tau", type=click.FloatRange(min=1), help="Oracle acceptance with this mean τ (in-process).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Sample every request at this temperature, in-process and through --url (prompt i seeded i; "
                   "DFlash with the lossless rule, real acceptance only). Default greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --temperature: sample from the k most likely tokens (0: all).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True,
              help="With --temperature: sample from the nucleus of this mass (1: all).")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Apply the chat template.")
@click.option("--thinking/--no-thinking", default=False, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), help="Default: the device the engine was built for.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, path_type=Path), help="Also write rows here.")
@click.option("--prefill-chunk-size", type=click.IntRange(min=0),
              help="Override the engine's prefill chunk (0: a prompt in one pass; see build --help).")
@click.option("--verify-width", type=click.Choice(["auto", "full", "adaptive"]),
              help="Override the engine's verify width (see build --help).")
@click.option("--overlap/--no-overlap", default=None,
              help="Overlap the host's work with the GPU's (the default: AR queues its next step, DFlash "
                   "its next draft, before reading the current one), or run the serial loop, to measure what "
                   "the overlap hides.")
@click.option("--oracle-dist", type=click.Choice(["two-point", "geometric"]), default="two-point", show_default=True,
              help="How --oracle-tau draws the correct drafts per step: the two integers around τ - 1, or i.i.d. "
                   "per draft with the rate that gives τ (a long tail).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Run AR and DFlash N times each per concurrency, alternating on one engine; the row is the run "
                   "of median speedup, with the lowest and highest: a change of a few percent told from noise.")
@click.option("--max-seq-len", type=click.IntRange(min=1),
              help="The engines' tokens a request (prompt + output), as a server built with it holds; attention "
                   "plans its work by that capacity where the context is not known. Default: what the longest "
                   "prompt and --max-tokens need.")
@click.option("--stall-prompt", type=click.IntRange(min=1), metavar="N",
              help="Instead of the throughput rows: a prompt of N tokens arrives while --concurrency requests "
                   "decode; their token gaps during its prefill, in one pass and in --prefill-chunk-size chunks.")
@_DRAFT_WINDOW
@_TENSOR_PARALLEL
def bench(output_dir, random_weights, urls, compare_transformers, datasets, concurrency, num_prompts, max_tokens,
          oracle_tau, temperature, top_k, top_p, chat, thinking, device, json_file, prefill_chunk_size, verify_width,
          overlap, oracle_dist, repeat, max_seq_len, stall_prompt, draft_window_size, tensor_parallel):
    """Benchmark AR vs DFlash per dataset and concurrency; markdown tables on stdout.

    \b
    dflash-trt bench out/q8 --dataset gsm8k --dataset humaneval --oracle-tau 6.5 --json bench.json
    dflash-trt bench --random-weights qwen3-8b --oracle-tau 6.5 --compare-transformers
    dflash-trt bench out/q8 --url localhost:8001     # also through a running `dflash-trt serve out/q8`
    dflash-trt bench --url localhost:8001 --url http://localhost:9000   # gRPC vs the OpenAI API
    dflash-trt bench --random-weights qwen3-8b --stall-prompt 30000 --prefill-chunk-size 2048 --concurrency 8
    """
    from dflash_trt import fa3
    from dflash_trt.benchmark import bench as bench_lib

    if output_dir is not None and random_weights is not None:
        raise click.UsageError("give OUTPUT_DIR or --random-weights, not both")
    if output_dir is None and random_weights is None and not urls:
        raise click.UsageError("give OUTPUT_DIR, --random-weights PRESET or --url HOST:PORT")
    if (compare_transformers or oracle_tau is not None) and output_dir is None and random_weights is None:
        raise click.UsageError("--compare-transformers and --oracle-tau need an in-process engine "
                               "(OUTPUT_DIR or --random-weights)")
    if (top_k or top_p < 1) and not temperature:
        raise click.UsageError("--top-k and --top-p shape sampling: they need --temperature > 0")
    if stall_prompt and (urls or compare_transformers or oracle_tau is not None):
        raise click.UsageError("--stall-prompt runs alone: not with --url, --compare-transformers or --oracle-tau")
    try:
        levels = [int(c) for c in concurrency.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated ints, got {concurrency!r}", param_hint="--concurrency")
    runs = (2 * repeat * len(levels) if output_dir or random_weights else 0) + len(levels) * len(urls) + \
        compare_transformers
    runs = 0 if stall_prompt else runs  # the stall test reports phases, not finished requests
    bar = (click.progressbar(length=runs * num_prompts * len(datasets), file=sys.stderr)
           if sys.stderr.isatty() and runs else None)
    progress = lambda n, msg: bar.update(n) if bar else (msg and click.echo(msg, err=True))  # noqa: E731
    with _errors():
        from dflash_trt.sampling import SamplingParams

        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p) if temperature else None
        loaded = _bench_engine(output_dir, random_weights, device, draft_window_size, tensor_parallel, max_seq_len)
        report = bench_lib.run_report(loaded, datasets, urls=urls, concurrencies=levels, num_prompts=num_prompts,
                                      max_tokens=max_tokens, chat=chat, thinking=thinking, oracle_tau=oracle_tau,
                                      compare_transformers=compare_transformers, progress=progress,
                                      prefill_chunk=prefill_chunk_size, stall_prompt=stall_prompt or 0,
                                      verify_width=verify_width, oracle_dist=oracle_dist, overlap=overlap,
                                      repeat=repeat, max_seq_len=max_seq_len, sampling=sampling)
    if bar:
        bar.render_finish()
    click.echo(bench_lib.format_report(report))
    if json_file:
        engine = str(output_dir) if output_dir else f"random:{random_weights}" if random_weights else None
        fa3_shapes = sorted((s.rows, s.tokens, "target" if s.causal else "drafter") for s in fa3.chosen())
        json_file.write_text(bench_lib.report_to_json(report, engine=engine, urls=list(urls), max_tokens=max_tokens,
                                                      gpu=bench_lib.device_name(loaded), fa3_shapes=fa3_shapes) + "\n")


def main():  # pragma: no cover - `python -m dflash_trt`
    cli(prog_name="dflash-trt")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
