"""`dflash-trt train`: data, the training loop, checkpoints and the closing evaluation.

One process per device; with several (torchrun, or `train --nproc N`) the drafter is wrapped in
DistributedDataParallel and rank r takes every N-th batch, and each rank writes the responses to
every N-th prompt. The frozen target computes its tapped hidden states online for each batch
(nothing is dumped to disk). A target one device cannot hold (`shard_target`) is sharded over
the ranks with FSDP for training (loading.shard_layers: each rank gathers one layer at a time
for its own batch), and split tensor-parallel for the engine that writes the data and evaluates
the drafter (sharded_engine: every rank computes its part of one engine's passes). A checkpoint
holds the drafter, the optimizer, the step and the data cursor; resuming from it continues the
same run (`tests/test_train.py` checks a resumed run ends with the uninterrupted run's weights).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import pickle
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from dflash_trt import parallel
from dflash_trt.config import DraftConfig, read_json
from dflash_trt.engine import Engine
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.kv_cache import Batch
from dflash_trt.loading import load_drafter, load_target, target_skeleton
from dflash_trt.models import load_target_config
from dflash_trt.sampling import SamplingParams
from dflash_trt.sequence import acceptance_summary
from dflash_trt.tokenizer import Tokenizer
from dflash_trt.training import data
from dflash_trt.training.drafter_files import (
    DrafterShape,
    checkpoint_tensors,
    initial_tensors,
    new_drafter_config,
    write_drafter,
)
from dflash_trt.training.objective import DraftObjective, draw_lengths, sample_anchors

CHECKPOINT, LOG, EVAL, DATA = "checkpoint.pt", "train_log.jsonl", "eval.json", "data"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8  # sequences per step and rank
    max_length: int = 1024  # tokens per sequence (longer ones are cut)
    num_anchors: int = 64  # blocks per sequence
    lr: float = 6e-4
    warmup: float = 0.04  # share of the steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    decay: float | None = None  # gamma of the slot weights; None: by block size (objective.default_decay)
    # smaller block sizes the drafter also learns to serve: each block draws its size among these
    # and the drafter's own (objective.draw_lengths)
    block_sizes: tuple[int, ...] = ()
    distill: bool = False  # learn the target's whole next-token distribution (DraftObjective.distillation)
    checkpoint_every: int = 200
    log_every: int = 10
    eval_prompts: int = 16  # the token dataset's last sequences, held out of training
    eval_max_tokens: int = 128
    seed: int = 0


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from when `--data` names prompts, not a token dataset."""

    chat: bool = True
    thinking: bool = False
    max_tokens: int = 512  # per response
    temperature: float = 0.0
    generate_batch: int = 32
    limit: int | None = None  # prompts used, at most


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine to zero."""
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.steps - warm)))


def _distributed(device: str | None) -> tuple[int, int]:
    """(rank, world) under torchrun or `--nproc`, with the process group up; (0, 1) alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():  # torchrun's ranks (`--nproc` starts the group in _rank_main)
        dist.init_process_group(_backend(device))
        # ended before the interpreter's teardown, where a live group's threads can abort the
        # process (pytorch/pytorch#179291) and torchrun would report a finished run as failed
        atexit.register(dist.destroy_process_group)
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _backend(device: str | None) -> str:
    return "nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"


def rank_device(device: str | None, local_rank: int, world: int, cuda: bool) -> torch.device:
    """The device a rank trains on: with several processes, "cuda" (or none given, on a GPU
    machine) means this rank's own GPU; one named GPU cannot serve them all (NCCL refuses two
    ranks on one device)."""
    if device is None:
        device = "cuda" if cuda else "cpu"
    chosen = torch.device(device)
    if chosen.type != "cuda" or world == 1:
        return chosen
    if chosen.index is not None:
        raise ConfigError(f"--device {device} names one GPU for {world} processes: pass --device cuda, and each "
                          "process takes the GPU of its rank")
    return torch.device("cuda", local_rank)


def _device(rank: int, device: str | None, world: int) -> torch.device:
    dev = rank_device(device, int(os.environ.get("LOCAL_RANK", rank)), world, torch.cuda.is_available())
    if dev.type == "cuda" and dev.index is not None:  # a bare "cuda" (one process) is the current GPU already
        torch.cuda.set_device(dev)  # collectives and "cuda" tensors without an index use it
    return dev


def check_dataset_size(sequences: int, cfg: TrainConfig, world: int, where) -> int:
    """The sequences left for training after the held-out ones, if they fill one step."""
    left = sequences - cfg.eval_prompts
    if left < cfg.batch_size * world:
        raise ConfigError(f"{where}: {sequences} sequences leave {left} for training after {cfg.eval_prompts} held "
                          f"out; one step needs {cfg.batch_size * world} (--batch-size {cfg.batch_size} x {world} "
                          "processes)")
    return left


def _target_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _mesh(device: torch.device, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,))


def sharded_engine(target_dir: Path, drafter_dir: Path | None, device: torch.device, rank: int, world: int,
                   **kwargs) -> Engine | None:
    """An engine over the target (and drafter) split tensor-parallel over the ranks
    (parallel.plan: each holds 1/N of every layer and computes 1/N of every pass, where FSDP's
    layer gathers would move the whole target per decode step). Rank 0's is a parallel.Leader,
    built with rank 0's kwargs, whose calls the other ranks repeat on theirs (parallel.follow)
    until it releases them; they get None."""
    group, dtype = parallel.Group(rank, world), _target_dtype(device)
    target = load_target(target_dir, device, dtype, group)
    drafter = load_drafter(drafter_dir, target, device, dtype, group) if drafter_dir else None
    kwargs = parallel.broadcast(kwargs if rank == 0 else None)
    if rank == 0:
        return parallel.Leader(target, drafter, **kwargs)
    parallel.follow(Engine(target, drafter, **kwargs))
    return None


def prepare_data(conversations: list[list[dict]] | None, target_dir: Path, out_dir: Path, cfg: DataConfig,
                 device: torch.device, progress=print, rank: int = 0, world: int = 1, shard: bool = False) -> Path:
    """The target's responses to `conversations`, generated once into out_dir/data as a token
    dataset (a resumed run finds it there). With several ranks every rank calls this: each
    answers every world-th prompt with the whole target and rank 0 puts the parts together;
    with `shard`, one engine over the target split across the ranks (sharded_engine) answers
    every prompt (only rank 0 needs the conversations)."""
    where = out_dir / DATA
    reuse = (where / data.INDEX_FILE).is_file()
    if world > 1:
        reuse = parallel.broadcast(reuse)
    if reuse:
        progress(f"data: reusing {where}")
        return where
    total = len(conversations[:cfg.limit]) if conversations is not None else 0
    # the prompts this rank's engine answers: every world-th, or over a sharded target all on rank 0
    numbers = range(rank, total, world) if not shard else range(total if rank == 0 else 0)
    tokenizer = Tokenizer.from_dir(target_dir)
    prompts = [data.encode_conversation(tokenizer, conversations[n], cfg.chat, cfg.thinking) for n in numbers]
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=0)
    split = f" (a share on each of {world} processes)" if world > 1 and not shard else ""
    start = time.perf_counter()
    sizes = dict(max_batch_size=cfg.generate_batch, max_seq_len=max(map(len, prompts), default=0) + cfg.max_tokens)
    if shard:
        engine = sharded_engine(target_dir, None, device, rank, world, **sizes)
    else:
        engine = Engine(load_target(target_dir, device, _target_dtype(device)), **sizes)
    if engine is not None:  # not a follower of rank 0's
        try:
            engine.warm_up()
            sequences = data.respond(engine, prompts, params, numbers,
                                     lambda done, total: progress(f"data: {done}/{total} responses{split}"))
        finally:
            if shard:
                engine.release()
        if world == 1 or shard:
            data.write_token_dataset(where, sequences)
        else:
            _write_share(out_dir, rank, world, sequences, where)
    if rank == 0:
        made = data.TokenDataset(where)
        progress(f"data: {len(made)} sequences, {made.num_response_tokens()} response tokens in "
                 f"{time.perf_counter() - start:.0f} s -> {where}")
    return where


def _write_share(out_dir: Path, rank: int, world: int, sequences: list, where: Path) -> None:
    """Each rank's answers as a token dataset of its own, then rank 0's interleaving of them
    (data.interleave) as the dataset at `where`; the parts are removed."""
    parts = [out_dir / f".{DATA}-part{r}" for r in range(world)]
    shutil.rmtree(parts[rank], ignore_errors=True)  # a killed run's
    data.write_token_dataset(parts[rank], sequences)
    dist.barrier()
    if rank == 0:
        data.write_token_dataset(where, data.interleave([data.TokenDataset(part) for part in parts]))
        for part in parts:
            shutil.rmtree(part)
    dist.barrier()  # the dataset is whole before any rank reads it


def initial_drafter(target_dir: Path, shape: DrafterShape, init_from: Path | None,
                    seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config and weights training starts from (checked before anything is written)."""
    if init_from is not None:  # the drafter's own weights: the target lends it only shapes
        drafter = load_drafter(init_from, target_skeleton(target_dir))
        return read_json(init_from / "config.json"), checkpoint_tensors(drafter)
    config = new_drafter_config(read_json(target_dir / "config.json"), Tokenizer.from_dir(target_dir).vocab_size, shape)
    return config, initial_tensors(config, seed)


class _Window:
    """What the steps since the last log line add up to: mean loss, loss per block slot,
    supervised tokens per second."""

    def __init__(self, block_size: int):
        self.sums, self.counts = torch.zeros(block_size), torch.zeros(block_size)
        self.loss, self.norm, self.steps, self.tokens, self.start = 0.0, 0.0, 0, 0, time.perf_counter()

    def add(self, loss, per_slot, count, norm, tokens: int) -> None:
        self.sums += per_slot.cpu()
        self.counts += count.cpu()
        self.loss, self.norm = self.loss + float(loss), max(self.norm, float(norm))
        self.steps, self.tokens = self.steps + 1, self.tokens + tokens

    def close(self, step: int, lr: float, epoch: int) -> dict:
        seconds = time.perf_counter() - self.start
        record = {"step": step, "loss": round(self.loss / self.steps, 4), "lr": lr,
                  "max_grad_norm": round(self.norm, 4), "tokens_per_s": round(self.tokens / seconds, 1),
                  "epoch": epoch, "steps": self.steps, "seconds": round(seconds, 3),
                  "slot_loss": [round(float(s / max(c, 1)), 3) for s, c in zip(self.sums, self.counts)][1:]}
        self.__init__(len(self.sums))
        return record


class Trainer:
    def __init__(self, target_dir: Path, dataset: data.TokenDataset, out_dir: Path, cfg: TrainConfig,
                 device: torch.device, rank: int = 0, world: int = 1, progress=print, mesh=None):
        """`mesh`: the device mesh to shard the target over (FSDP), or None: whole on every rank."""
        self.cfg, self.out_dir, self.device, self.rank, self.world = cfg, out_dir, device, rank, world
        self.progress = progress if rank == 0 else (lambda *_: None)
        self.target_dir, self.mesh = target_dir, mesh
        self.target = load_target(target_dir, device, _target_dtype(device), fsdp=self.mesh)
        self.target.requires_grad_(False)
        self.drafter = load_drafter(out_dir, self.target, device, torch.float32)  # fp32 master weights
        self.drafter.requires_grad_(True)
        self.config = read_json(out_dir / "config.json")
        self.objective = DraftObjective(self.drafter, cfg.decay)
        self.model = DistributedDataParallel(self.objective) if world > 1 else self.objective
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=(0.9, 0.95))
        self.dataset = dataset
        self.train_size = check_dataset_size(len(dataset), cfg, world, dataset.directory)
        self.step, self.cursor = 0, data.Cursor()
        self.stop_requested = False

    # -- checkpoints --------------------------------------------------------------------

    def save(self) -> None:
        """The drafter (z-lab layout, bf16) and the state to resume from, each replaced whole."""
        if self.rank != 0:
            return
        write_drafter(self.out_dir, self.config, checkpoint_tensors(self.drafter))
        state = {"step": self.step, "cursor": asdict(self.cursor), "optimizer": self.optimizer.state_dict(),
                 "drafter": {k: v.detach().cpu() for k, v in self.drafter.state_dict().items()},
                 "train_config": asdict(self.cfg)}
        staged = self.out_dir / f".{CHECKPOINT}.tmp"
        torch.save(state, staged)
        os.replace(staged, self.out_dir / CHECKPOINT)

    def restore(self) -> None:
        path = self.out_dir / CHECKPOINT
        if not path.is_file():
            raise ConfigError(f"{path}: no checkpoint to resume from")
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.cursor = state["step"], data.Cursor(**state["cursor"])
        self.progress(f"resumed at step {self.step} (epoch {self.cursor.epoch}, batch {self.cursor.batch})")

    # -- the loop -----------------------------------------------------------------------

    def target_pass(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen target over every position -> (final hidden [bs, S, H], taps [bs, S, K*H])."""
        bs, S = ids.shape
        batch = Batch.make(list(range(bs)), [0] * bs, [S] * bs, S, self.device)
        cache = self.target.new_cache(bs, S)
        with torch.no_grad():
            return self.target(ids, batch, cache, self.drafter.config.target_layer_ids)

    def train_step(self, ids: torch.Tensor, mask: torch.Tensor):
        cfg = self.cfg
        ids, mask = ids.to(self.device), mask.to(self.device)
        anchors_rng = torch.Generator().manual_seed(cfg.seed * 7919 + self.step * 31 + self.rank)
        blocks = sample_anchors(mask, cfg.num_anchors, anchors_rng)
        if cfg.block_sizes:
            blocks = draw_lengths(blocks, (*cfg.block_sizes, self.drafter.config.block_size), anchors_rng)
        hidden, taps = self.target_pass(ids)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.step, cfg)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            loss, per_slot, counts = self.model(ids, mask, taps, blocks, hidden if cfg.distill else None)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        return loss.detach(), per_slot, counts, norm

    def run(self) -> None:
        cfg = self.cfg
        stream = data.batches(self.dataset, self.train_size, cfg.batch_size, cfg.max_length, cfg.seed, self.cursor,
                              self.rank, self.world)
        signal.signal(signal.SIGTERM, self._request_stop)
        window = _Window(self.drafter.config.block_size)
        try:
            while self.step < cfg.steps and not self.stop_requested:
                cursor, ids, mask = next(stream)
                loss, per_slot, count, norm = self.train_step(ids, mask)
                self.cursor = cursor
                window.add(loss, per_slot, count, norm, int(mask.sum()) * self.world)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    self._log(window.close(self.step, learning_rate(self.step - 1, cfg), cursor.epoch))
                if self.step % cfg.checkpoint_every == 0:
                    self.save()
        finally:
            self.save()  # at exit, whatever ended the loop

    def _log(self, record: dict) -> None:
        eta = (self.cfg.steps - self.step) * record["seconds"] / max(1, record["steps"])
        self.progress(f"step {self.step}/{self.cfg.steps} loss {record['loss']:.3f} "
                      f"(slots 1-3: {', '.join(f'{x:.2f}' for x in record['slot_loss'][:3])}) "
                      f"{record['tokens_per_s']:.0f} tok/s, ETA {eta:.0f} s")
        if self.rank == 0:
            with (self.out_dir / LOG).open("a") as log:
                log.write(json.dumps(record) + "\n")

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True  # the step in flight finishes, then the loop saves and ends

    # -- the closing evaluation ---------------------------------------------------------

    def evaluate(self, temperatures: tuple[float, ...] = (0.0,)) -> dict:
        """Real acceptance of the written drafter on the held-out prompts, through the engine, at
        its block size and at each smaller one it was trained for (`block_S` keys; over a sharded
        target every rank calls this, rank 0 gets the report, and the trainer's models are
        dropped first: training is over)."""
        prompts = [list(map(int, self.dataset[i][0][:self.dataset[i][1]]))
                   for i in range(self.train_size, len(self.dataset))]
        if not prompts:
            return {}
        longest = max(map(len, prompts)) + self.cfg.eval_max_tokens
        sizes = dict(max_batch_size=min(16, len(prompts)), max_seq_len=longest)
        if self.mesh is not None:  # the target and the written drafter split over the ranks
            # their parts take the room of the training's models, which end here
            self.target = self.drafter = self.objective = self.model = self.optimizer = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        else:  # the written drafter in the target's dtype, as `build` would pair them
            drafter = load_drafter(self.out_dir, self.target, self.device, self.target.lm_head.weight.dtype)
        report = {"prompts": len(prompts)}
        for block in (0, *self.cfg.block_sizes):  # 0: the drafter's own
            if self.mesh is not None:
                engine = sharded_engine(self.target_dir, self.out_dir, self.device, self.rank, self.world,
                                        block_size=block, **sizes)
                if engine is None:  # a follower: its part of the leader's engine has run
                    continue
            else:
                engine = Engine(self.target, drafter, block_size=block, **sizes)
            try:
                engine.warm_up()
                measured = {"block_size": engine.block_size}
                for temperature in temperatures:
                    params = [SamplingParams(max_tokens=self.cfg.eval_max_tokens, temperature=temperature, seed=i)
                              for i in range(len(prompts))]
                    results = engine.generate(prompts, params, mode="dflash")
                    measured[f"temperature_{temperature:g}"] = acceptance_summary([r.stats for r in results],
                                                                                  engine.block_size)
            finally:
                if self.mesh is not None:
                    engine.release()
            if block:
                report[f"block_{block}"] = measured
            else:
                report.update(measured)
        return report


def train(target_dir: Path, source: str, out_dir: Path, *, shape: DrafterShape = DrafterShape(),
          cfg: TrainConfig = TrainConfig(), data_cfg: DataConfig = DataConfig(), init_from: Path | None = None,
          resume: bool = False, device: str | None = None, temperatures: tuple[float, ...] = (0.0,),
          shard_target: bool = False, progress=print) -> dict:
    """Train a drafter for the target into out_dir (z-lab layout); returns the evaluation.
    `shard_target`: for a target one device cannot hold, FSDP over the ranks for training and
    tensor parallelism for the engine that writes the data and evaluates (sharded_engine)."""
    rank, world = _distributed(device)
    if shard_target and world == 1:
        raise ConfigError("shard_target shards the target over several processes: train with --nproc N (N > 1) "
                          "or under torchrun")
    dev = _device(rank, device, world)
    progress = progress if rank == 0 else (lambda *_: None)
    mesh = _mesh(dev, world) if shard_target else None
    given = conversations = start_from = None
    if rank == 0:
        if (out_dir / CHECKPOINT).is_file() and not resume:
            raise ConfigError(f"{out_dir} already holds a training run ({CHECKPOINT}): pass --resume to continue it, "
                              "or choose another output directory")
        if resume and not (out_dir / CHECKPOINT).is_file():
            raise ConfigError(f"{out_dir / CHECKPOINT}: no checkpoint to resume from")
        given = Path(source) if (Path(source) / data.INDEX_FILE).is_file() else None  # a token dataset
        conversations = None if given else data.read_conversations(source)  # read before anything is written
        if conversations is not None and not shard_target and len(conversations[:data_cfg.limit]) < world:
            raise ConfigError(f"{source}: {len(conversations[:data_cfg.limit])} prompts are fewer than the {world} "
                              "processes that answer them")
        start_from = None if resume else initial_drafter(target_dir, shape, init_from, cfg.seed)
        drafter_config = start_from[0] if start_from else read_json(out_dir / "config.json")
        check_block_sizes(cfg.block_sizes, drafter_config["block_size"])
        if shard_target:  # its engine splits every layer over the ranks (sharded_engine)
            _check_splits(target_dir, drafter_config, world)
        if not resume:  # a prompt makes one sequence: too few to train on fail before they are answered
            sequences = len(data.TokenDataset(given)) if given else len(conversations[:data_cfg.limit])
            check_dataset_size(sequences, cfg, world, source)
        out_dir.mkdir(parents=True, exist_ok=True)
    if world > 1:
        given = parallel.broadcast(given)  # without one, every rank takes part in writing the data
    dataset_dir = given
    if dataset_dir is None:
        if rank != 0 and not shard_target:
            conversations = data.read_conversations(source)  # rank 0 read them the same way
        dataset_dir = prepare_data(conversations, target_dir, out_dir, data_cfg, dev, progress, rank, world,
                                   shard_target)
    if start_from:
        write_drafter(out_dir, *start_from, torch.float32)
        (out_dir / LOG).unlink(missing_ok=True)
    if world > 1:
        dist.barrier()  # the drafter rank 0 wrote, before every rank loads it
    trainer = Trainer(target_dir, data.TokenDataset(dataset_dir), out_dir, cfg, dev, rank, world, progress, mesh)
    if resume:
        trainer.restore()
    start = time.perf_counter()
    trainer.run()
    seconds = round(time.perf_counter() - start, 1)
    if trainer.stop_requested:
        return {}
    if mesh is not None:
        dist.barrier()  # the drafter rank 0 wrote, before every rank loads its part to evaluate it
    evaluation = trainer.evaluate(temperatures) if rank == 0 or mesh is not None else {}
    if rank != 0:
        return {}
    report = {"train_seconds": seconds, "steps": trainer.step, **evaluation}
    if dev.type == "cuda":
        report["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
    (out_dir / EVAL).write_text(json.dumps(report, indent=1) + "\n")
    return report


def check_block_sizes(sizes: tuple[int, ...], block_size: int) -> None:
    for size in sizes:
        if not 2 <= size < block_size:
            raise ConfigError(f"block size {size} to train beside the drafter's {block_size} must be at least 2 "
                              f"and less than {block_size}")


def _check_splits(target_dir: Path, drafter_config: dict, world: int) -> None:
    """The target's and the drafter's heads and widths split over `world` ranks (the sharded
    engine's), checked before anything is written, not when the trained drafter is evaluated."""
    target = load_target_config(target_dir)
    parallel.check_supported(target, world)
    try:
        parallel.check_supported(DraftConfig.from_mapping(drafter_config, Path("config.json"),
                                                          target.dims.num_hidden_layers), world)
    except ConfigError as e:
        raise ConfigError(f"the drafter's {e}") from None


def _rank_main(rank: int, world: int, folder: str, kwargs: dict) -> None:
    """One rank of train_processes; `folder` holds the group's rendezvous, rank 0's report and
    a rank's domain error, for the parent to raise as itself."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    backend = _backend(kwargs.get("device"))
    if backend == "gloo":
        parallel.share_cpu_threads(world)
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        report = train(**kwargs)
        if rank == 0:
            Path(folder, "report.json").write_text(json.dumps(report))
        dist.barrier()  # no rank tears the group down while another still talks to it
    except DFlashError as e:
        Path(folder, f"error.{rank}").write_bytes(pickle.dumps(e))
        raise
    finally:
        dist.destroy_process_group()
    parallel.leave()


def train_processes(nproc: int, **kwargs) -> dict:
    """`train` in `nproc` processes (one per GPU, or gloo on the CPU), started here; a rank's
    domain error (bad input, say) is raised here as itself."""
    with tempfile.TemporaryDirectory(prefix="dflash-trt-train-") as tmp:
        try:
            mp.start_processes(_rank_main, args=(nproc, tmp, kwargs), nprocs=nproc, start_method="spawn")
        except mp.ProcessRaisedException:
            errors = sorted(Path(tmp).glob("error.*"))
            if errors:
                raise pickle.loads(errors[0].read_bytes()) from None
            raise
        return json.loads(Path(tmp, "report.json").read_text())
