"""Train a small byte-level Mixture-of-Experts language model built from LRMoE layers.

Launch with the DeepSpeed launcher, as any DeepSpeed job:

    deepspeed --num_gpus 2 train.py --deepspeed_config ds_configs/cpu_ep2.json   # 2 CPU ranks, gloo
    deepspeed --num_gpus 1 train.py --deepspeed_config ds_configs/h200.json

Data: by default the Python standard library's own source files (present on every machine with
Python, no download), split into training and held-out text by file; ``--data`` takes your own text
files or folders instead. The vocabulary is the 256 byte values; losses are in nats per byte.

Each optimizer step consumes one global batch of ``train_batch_size`` windows of ``seq_len + 1``
bytes; data-parallel rank r reads its own slice of every micro-step's share of it. The order of the
windows depends only on ``--seed`` and the step, so a resumed run (``--resume``) reads exactly what
the uninterrupted run would have read.

The ds_config may carry a ``"train_py"`` block of defaults for this script's flags (flag names
without dashes, e.g. ``{"layers": 8, "hidden": 512}``): ds_configs/h200.json sizes its model that way.
Flags on the command line win.

Logged through DeepSpeed's monitor (the config's ``csv_monitor``, ``tensorboard``, ``wandb``):
``Train/loss`` (LM cross-entropy, nats/byte), ``Train/aux_loss``, ``Train/lr``,
``Train/tokens_per_s``, ``Train/grad_norm`` (DeepSpeed's global gradient norm before clipping, where the
config clips), ``Load/layer<i>/max_over_mean`` and ``Load/layer<i>/expert<e>`` (fraction of
the routed token-expert pairs that went to expert e, summed over all ranks since the last log), and
``Eval/loss`` (held-out nats/byte).
"""
import argparse
import json
import math
import os
import random
import sys
import sysconfig
import time
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed
import deepspeed.comm as dist

# --------------------------------------------------------------------------------------------------
# The MoE implementation: the only place that knows which MoE layer and which initialize is used.
# --------------------------------------------------------------------------------------------------


class SwiGLU(nn.Module):
    """Expert MLP for the DeepSpeed baseline: x [T, H] -> [T, H] through F = ffn hidden units."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.w_gate = nn.Linear(hidden, ffn, bias=False)
        self.w_up = nn.Linear(hidden, ffn, bias=False)
        self.w_down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


def make_moe(args):
    """One MoE FFN layer: a module whose forward maps x [B, S, H] to (y [B, S, H], l_aux, exp_counts [E])."""
    if args.moe_impl == "lrmoe":
        import lrmoe_ds
        sigmoid = args.router == "sigmoid_bias"
        return lrmoe_ds.LRMoE(hidden_size=args.hidden, num_experts=args.experts, ep_size=args.ep_size,
                              k=args.top_k, ffn_hidden_size=args.ffn, activation="swiglu",
                              score_func="sigmoid" if sigmoid else "softmax", expert_bias=sigmoid)
    from deepspeed.moe.layer import MoE
    moe = MoE(hidden_size=args.hidden, expert=SwiGLU(args.hidden, args.ffn), num_experts=args.experts,
              ep_size=args.ep_size, k=args.top_k, drop_tokens=False, use_rts=False,
              top2_2nd_expert_sampling=False)
    # DeepSpeed deep-copies one expert module: give each expert its own initial weights, seeded by
    # its global index so that the model is the same whatever ep_size is.
    local = moe.deepspeed_moe.experts.deepspeed_experts
    ep_rank = dist.get_rank() % args.ep_size if args.ep_size > 1 else 0  # ranks [0, ep) form group 0
    for i, expert in enumerate(local):
        g = torch.Generator().manual_seed(args.seed * 7919 + 1 + ep_rank * len(local) + i)
        for p in expert.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return moe


def initialize(args, model, config):
    """deepspeed.initialize with DeepSpeed's MoE parameter groups; returns (engine, optimizer, scheduler)."""
    if args.moe_impl == "lrmoe":
        import lrmoe_ds
        engine, optimizer, _, scheduler = lrmoe_ds.initialize(args=args, model=model, config=config)
        return engine, optimizer, scheduler
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "params"})
    engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model, model_parameters=groups,
                                                           config=config)
    return engine, optimizer, scheduler


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal multi-head self-attention: x [B, S, H] -> [B, S, H]."""

    def __init__(self, hidden, heads):
        super().__init__()
        assert hidden % heads == 0, f"--hidden {hidden} must be divisible by --heads {heads}"
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, S, H/heads]
        return self.out(y.transpose(1, 2).reshape(B, S, H))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then the MoE FFN."""

    def __init__(self, args):
        super().__init__()
        self.norm1 = nn.RMSNorm(args.hidden)
        self.attn = Attention(args.hidden, args.heads)
        self.norm2 = nn.RMSNorm(args.hidden)
        self.moe = make_moe(args)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        y, l_aux, exp_counts = self.moe(self.norm2(x))
        return x + y, l_aux, exp_counts


def lm_outputs(logits, targets, aux, counts):
    """What both models return: (byte cross-entropy, the layers' aux losses summed, exp_counts [L, E] fp32)."""
    lm_loss = F.cross_entropy(logits.float().view(-1, 256), targets.reshape(-1))
    counts = [c.to(device=targets.device, dtype=torch.float32) for c in counts]
    return lm_loss, torch.stack([a.float() for a in aux]).sum(), torch.stack(counts)


class ByteMoELM(nn.Module):
    """Decoder-only byte-level MoE LM. forward(idx [B, S], targets [B, S]) -> (lm_loss, aux_loss, exp_counts [L, E])."""

    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(256, args.hidden)
        self.pos = nn.Embedding(args.seq_len, args.hidden)
        self.blocks = nn.ModuleList([Block(args) for _ in range(args.layers)])
        self.norm = nn.RMSNorm(args.hidden)
        self.head = None if args.tied_head else nn.Linear(args.hidden, 256, bias=False)
        for name, p in self.named_parameters():
            if "moe" not in name and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        for block in self.blocks:  # GPT-2 style scaling of the residual projections
            nn.init.normal_(block.attn.out.weight, std=0.02 / math.sqrt(2 * args.layers))

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx) + self.pos(pos)
        aux, counts = [], []
        for block in self.blocks:
            x, l_aux, exp_counts = block(x)
            aux.append(l_aux)
            counts.append(exp_counts)
        x = self.norm(x)
        logits = x @ self.embed.weight.t() if self.head is None else self.head(x)
        return lm_outputs(logits, targets, aux, counts)


class HFQwen3MoeLM(nn.Module):
    """The same byte-level job on a Hugging Face Qwen3-MoE model of the same size (transformers >= 5, built
    from a config, nothing downloaded), its MoE blocks converted to LRMoE layers by lrmoe_ds.convert_hf_moe.
    forward(idx [B, S], targets [B, S]) -> (lm_loss, aux_loss, exp_counts [L, E]), as ByteMoELM."""

    def __init__(self, args):
        super().__init__()
        import transformers
        import lrmoe_ds
        config = transformers.Qwen3MoeConfig(
            vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.heads, head_dim=args.hidden // args.heads, num_experts=args.experts,
            num_experts_per_tok=args.top_k, moe_intermediate_size=args.ffn, intermediate_size=args.ffn,
            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=args.seq_len,
            tie_word_embeddings=args.tied_head, norm_topk_prob=True, output_router_logits=False)
        self.hf = transformers.Qwen3MoeForCausalLM(config)
        lrmoe_ds.convert_hf_moe(self.hf, ep_size=args.ep_size)
        self.blocks = [m for m in self.hf.modules() if isinstance(m, lrmoe_ds.hf.HFMoEBlock)]

    def forward(self, idx, targets):
        logits = self.hf(input_ids=idx).logits
        return lm_outputs(logits, targets, [b.l_aux for b in self.blocks], [b.exp_counts for b in self.blocks])


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "encodings"}  # encodings: codec tables
_TEST_DIRS = {"test", "tests", "idle_test"}


def list_files(paths, stdlib_tests=False):
    """Text files under the given files/folders, as a sorted list of (name, path).

    Default (no paths): the stdlib's .py files (about 10 MB; 30 MB with its test suites).
    """
    if not paths:
        root = sysconfig.get_paths()["stdlib"]
        skip = _SKIP_DIRS if stdlib_tests else _SKIP_DIRS | _TEST_DIRS
        out = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip]
            out += [(os.path.relpath(os.path.join(dirpath, f), root), os.path.join(dirpath, f))
                    for f in filenames if f.endswith(".py")]
        return sorted(out)
    out = []
    for path in paths:
        if os.path.isdir(path):
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                out += [(os.path.join(dirpath, f), os.path.join(dirpath, f)) for f in filenames]
        elif os.path.isfile(path):
            out.append((path, path))
        else:
            raise FileNotFoundError(f"--data: no such file or folder: {path}")
    return sorted(out)


def load_corpus(paths, train_bytes, val_bytes, val_every, stdlib_tests=False):
    """Read the corpus and split it by file: every val_every-th file of a seeded shuffle is held out
    (a single file: its tail).

    Files are read in a fixed shuffled order (seed 0 over the sorted list) until each split has its
    byte budget. Returns (train, val) as uint8 tensors and a short description.
    """
    files = list_files(paths, stdlib_tests)
    if len(files) == 1:  # one file: hold out its tail
        with open(files[0][1], "rb") as f:
            data = f.read()
        cut = len(data) - min(val_bytes, len(data) // 10)
        train, val = data[:cut][:train_bytes], data[cut:]
        desc = f"{files[0][0]}: {len(train)} training bytes, {len(val)} held-out bytes (its tail)"
        return _as_tensor(train), _as_tensor(val), desc
    random.Random(0).shuffle(files)
    train, val, n_train, n_val = [], [], 0, 0
    for i, (name, path) in enumerate(files):
        to_val = i % val_every == 0
        if (to_val and n_val >= val_bytes) or (not to_val and n_train >= train_bytes):
            if n_val >= val_bytes and n_train >= train_bytes:
                break
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data[:4096]:  # binary, not text
            continue
        (val if to_val else train).append(data)
        if to_val:
            n_val += len(data)
        else:
            n_train += len(data)
    train = b"".join(train)[:train_bytes]
    val = b"".join(val)[:val_bytes]
    desc = (f"{'stdlib ' + sysconfig.get_paths()['stdlib'] if not paths else ' '.join(paths)}: "
            f"{len(train)} training bytes, {len(val)} held-out bytes, crc32 {zlib.crc32(train + val):08x}")
    return _as_tensor(train), _as_tensor(val), desc


def _as_tensor(data):
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


class WindowSampler:
    """Window g of the training stream, for any global sample index g, by a seeded per-epoch permutation.

    The stream is cut into N = (len - 1) // seq_len windows of seq_len + 1 bytes (inputs and shifted
    targets); epoch e visits them in the order of a permutation seeded by (seed, e).
    """

    def __init__(self, data, seq_len, seed):
        self.data, self.seq_len, self.seed = data, seq_len, seed
        self.n = (len(data) - 1) // seq_len
        assert self.n > 0, f"training text ({len(data)} bytes) is shorter than one window of {seq_len + 1}"
        self._perm_epoch, self._perm = None, None

    def windows(self, start, count):
        """Windows start .. start+count-1 as int64 [count, seq_len + 1]."""
        rows = []
        for g in range(start, start + count):
            epoch, i = divmod(g, self.n)
            if epoch != self._perm_epoch:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm, self._perm_epoch = torch.randperm(self.n, generator=gen), epoch
            j = int(self._perm[i]) * self.seq_len
            rows.append(self.data[j:j + self.seq_len + 1])
        return torch.stack(rows).long()


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------

TRAIN_PY_KEY = "train_py"  # ds_config block of defaults for this script's flags


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p.add_argument("--steps", type=int, default=500, help="optimizer steps in all; the LR schedule spans them")
    p.add_argument("--eval_every", type=int, default=100, help="held-out eval every N steps (0: at start and end only)")
    p.add_argument("--eval_bytes", type=int, default=64 << 10, help="held-out bytes evaluated each time")
    p.add_argument("--log_every", type=int, default=10, help="monitor events every N steps")
    p.add_argument("--save_dir", default="checkpoints", help="checkpoint folder ('' to save nothing)")
    p.add_argument("--save_every", type=int, default=0, help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save_dir")
    p.add_argument("--stop_at", type=int, default=None,
                   help="stop (and save) at this step as an interrupted run would; the LR schedule still spans --steps")
    p.add_argument("--summary_json", default=None, help="write the run's summary here as JSON (rank 0)")
    p.add_argument("--data", nargs="+", default=None, help="text files or folders (default: the stdlib's sources)")
    p.add_argument("--stdlib_tests", action=argparse.BooleanOptionalAction, default=False,
                   help="default corpus: include the stdlib's test suites (30 MB instead of 10 MB)")
    p.add_argument("--train_bytes", type=int, default=4 << 20, help="training text budget in bytes")
    p.add_argument("--val_bytes", type=int, default=256 << 10, help="held-out text budget in bytes")
    p.add_argument("--val_every", type=int, default=10, help="every N-th file (shuffled order) is held out")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256, help="hidden units of each expert")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--ep_size", type=int, default=None,
                   help="expert-parallel size (default: gcd(world size, --experts), as much as they allow)")
    p.add_argument("--aux_loss_coef", type=float, default=0.01)
    p.add_argument("--tied_head", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--arch", choices=["byte_moe", "hf_qwen3_moe"], default="byte_moe",
                   help="byte_moe: this file's model; hf_qwen3_moe: a Hugging Face Qwen3-MoE of the same size, "
                        "its MoE blocks converted to LRMoE (needs transformers >= 5 and --moe_impl lrmoe)")
    p.add_argument("--moe_impl", choices=["lrmoe", "deepspeed"], default="lrmoe",
                   help="lrmoe: lrmoe_ds.LRMoE (the default); deepspeed: deepspeed.moe.layer.MoE, dropless (baseline)")
    p.add_argument("--router", choices=["softmax", "sigmoid_bias"], default="softmax",
                   help="byte_moe with lrmoe: softmax top-k (Qwen3's), or sigmoid scores with a selection bias "
                        "(DeepSeek-V3's, GLM-4.5's), which the \"lrmoe\" block's expert_bias_update_rate balances "
                        "(then --aux_loss_coef 0 trains without a balance loss)")
    p.add_argument("--seed", type=int, default=1234)
    return deepspeed.add_config_arguments(p)


def parse_args(argv=None):
    """Flags; the ds_config's optional "train_py" block (flag names without dashes) sets their defaults."""
    p = build_parser()
    args = p.parse_args(argv)
    if not args.deepspeed_config:
        p.error("--deepspeed_config is required (e.g. ds_configs/cpu_ep2.json)")
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            block = json.load(f).get(TRAIN_PY_KEY, {})
        known = {a.dest for a in p._actions}
        unknown = sorted(set(block) - known)
        if unknown:
            p.error(f'unknown key(s) {unknown} in the ds_config\'s "{TRAIN_PY_KEY}" block; they are train.py flags')
        p.set_defaults(**block)
        args = p.parse_args(argv)
    return args


def load_config(args):
    """The ds_config as a dict, without the "train_py" block; the LR schedule's length follows --steps."""
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    config.pop(TRAIN_PY_KEY, None)
    sched = config.get("scheduler", {})
    if sched.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        params = sched.setdefault("params", {})
        params["total_num_steps"] = args.steps
        params["warmup_num_steps"] = min(params.get("warmup_num_steps", 0), max(1, args.steps // 5))
    return config


@torch.no_grad()
def evaluate(engine, val, args):
    """Held-out LM loss in nats/byte over the first --eval_bytes of the held-out text, sharded over ranks.

    Every rank runs the same number of batches (the MoE layers communicate).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    bs = engine.train_micro_batch_size_per_gpu()
    n = min(len(val), args.eval_bytes) - 1
    windows = val[:n // args.seq_len * args.seq_len + 1]
    count = (len(windows) - 1) // args.seq_len
    per_batch = world * bs
    count = count // per_batch * per_batch
    assert count > 0, f"held-out text too short for one eval batch of {per_batch} x {args.seq_len + 1} bytes"
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)
    for b in range(rank * bs, count, per_batch):
        rows = torch.stack([windows[i * args.seq_len:(i + 1) * args.seq_len + 1] for i in range(b, b + bs)]).long()
        rows = rows.to(engine.device)
        lm, _, _ = engine(rows[:, :-1], rows[:, 1:])
        total += torch.tensor([lm.item() * rows[:, 1:].numel(), rows[:, 1:].numel()], dtype=torch.float64,
                              device=engine.device)
    dist.all_reduce(total)
    engine.train()
    return (total[0] / total[1]).item()


def main(argv=None):
    args = parse_args(argv)
    deepspeed.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.ep_size is None:
        args.ep_size = math.gcd(world, args.experts)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    train_data, val_data, desc = load_corpus(args.data, args.train_bytes, args.val_bytes, args.val_every,
                                             args.stdlib_tests)
    sampler = WindowSampler(train_data, args.seq_len, args.seed)
    if args.router != "softmax" and (args.arch != "byte_moe" or args.moe_impl != "lrmoe"):
        raise SystemExit("--router sigmoid_bias is for --arch byte_moe with --moe_impl lrmoe")
    if args.arch == "hf_qwen3_moe" and args.moe_impl != "lrmoe":
        raise SystemExit("--arch hf_qwen3_moe converts its MoE blocks to LRMoE: it needs --moe_impl lrmoe")
    model = ByteMoELM(args) if args.arch == "byte_moe" else HFQwen3MoeLM(args)
    config = load_config(args)
    args.deepspeed_config = None  # passed as a dict below
    engine, _, _ = initialize(args, model, config)
    dev = engine.device
    assert engine.dp_world_size == world, "train.py supports data and expert parallelism only"
    mb, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    global_batch = mb * gas * world
    n_params = sum(p.numel() for p in model.parameters())
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"data: {desc}")
    log(f"model: {args.arch}, {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
        f"(ffn {args.ffn}, top-{args.top_k}), "
        f"ep_size {args.ep_size}, {args.moe_impl}; {n_params} parameters on rank 0; world {world}, "
        f"global batch {global_batch} x {args.seq_len} bytes (micro {mb}, accumulation {gas})")

    step = 0
    if args.resume:
        path, client = engine.load_checkpoint(args.save_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {args.save_dir!r}")
        step = client["step"]
        if client.get("global_batch") != global_batch or client.get("seq_len") != args.seq_len:
            log(f"warning: the checkpoint was trained with global batch {client.get('global_batch')} x "
                f"{client.get('seq_len')}; the data position is kept as a step count")
        log(f"resumed from {path} at step {step}")

    def save(step):
        if args.save_dir:
            engine.save_checkpoint(args.save_dir, tag=f"step{step}",
                                   client_state={"step": step, "global_batch": global_batch, "seq_len": args.seq_len})

    def write(events):
        if engine.monitor.enabled:
            engine.monitor.write_events(events)

    start_step, t_start = step, time.time()
    start_loss = evaluate(engine, val_data, args)
    log(f"step {step}: held-out loss {start_loss:.4f} nats/byte")
    t_train = time.time()
    write([("Eval/loss", start_loss, step)])
    evals = [(step, start_loss)]

    from tqdm import tqdm
    bar = tqdm(total=args.steps, initial=step, disable=rank != 0, dynamic_ncols=True, desc="train")
    acc = torch.zeros(2, device=dev)  # summed lm loss, aux loss over micro-steps since the last log
    acc_counts, acc_micro, t_log, step_log = None, 0, time.time(), step
    norm_sum, norm_n = 0.0, 0
    stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    eval_time = 0.0
    while step < stop:
        for m in range(gas):
            first = step * global_batch + m * mb * world + rank * mb
            rows = sampler.windows(first, mb).to(dev)
            lm, aux, counts = engine(rows[:, :-1], rows[:, 1:])
            engine.backward(lm + args.aux_loss_coef * aux)
            engine.step()
            acc += torch.stack([lm.detach().float(), aux.detach().float()])
            acc_counts = counts if acc_counts is None else acc_counts + counts
            acc_micro += 1
        # DeepSpeed's global gradient norm before clipping (None where DeepSpeed did not compute one)
        norm = engine.get_global_grad_norm()
        if norm is not None:
            norm_sum, norm_n = norm_sum + float(norm), norm_n + 1
        step += 1
        bar.update(1)
        if step % args.log_every == 0 or step == stop:
            stats = torch.cat([acc / acc_micro, acc_counts.flatten()]).to(dev)
            dist.all_reduce(stats)
            lm_avg, aux_avg = (stats[:2] / world).tolist()
            counts = stats[2:].view(args.layers, args.experts).cpu()
            frac = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
            tok_s = (step - step_log) * global_batch * args.seq_len / (time.time() - t_log)
            events = [("Train/loss", lm_avg, step), ("Train/aux_loss", aux_avg, step),
                      ("Train/lr", engine.get_lr()[0], step), ("Train/tokens_per_s", tok_s, step)]
            if norm_n:
                events.append(("Train/grad_norm", norm_sum / norm_n, step))
            for layer in range(args.layers):
                events.append((f"Load/layer{layer}/max_over_mean", (frac[layer].max() * args.experts).item(), step))
                events += [(f"Load/layer{layer}/expert{e}", frac[layer, e].item(), step) for e in range(args.experts)]
            write(events)
            bar.set_postfix(loss=f"{lm_avg:.3f}", tok_s=f"{tok_s:.0f}",
                            load=f"{(frac.max(dim=1).values * args.experts).max().item():.2f}")
            acc.zero_()
            acc_counts, acc_micro, t_log, step_log = None, 0, time.time(), step
            norm_sum, norm_n = 0.0, 0
        if args.eval_every and step % args.eval_every == 0 and step < stop:
            t_eval = time.time()
            loss = evaluate(engine, val_data, args)
            eval_time += time.time() - t_eval
            t_log += time.time() - t_eval  # tokens/s counts training time only
            evals.append((step, loss))
            if rank == 0:
                bar.write(f"step {step}: held-out loss {loss:.4f} nats/byte")
            write([("Eval/loss", loss, step)])
        if args.save_every and step % args.save_every == 0 and step < stop:
            save(step)
    bar.close()
    train_time = time.time() - t_train - eval_time
    end_loss = evaluate(engine, val_data, args) if step > start_step or not evals else start_loss
    if evals[-1][0] != step:
        evals.append((step, end_loss))
        write([("Eval/loss", end_loss, step)])
    save(step)
    tokens = (step - start_step) * global_batch * args.seq_len
    wall = time.time() - t_start
    summary = {"start_step": start_step, "end_step": step, "start_loss": start_loss, "end_loss": end_loss,
               "evals": evals, "seconds": wall, "train_seconds": train_time, "tokens": tokens,
               "tokens_per_s": tokens / max(train_time, 1e-9),
               "world": world, "ep_size": args.ep_size, "moe_impl": args.moe_impl, "arch": args.arch,
               # the GPU's peak allocated memory of this rank over the run (None on CPU ranks)
               "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None}
    log(f"final: held-out loss {start_loss:.4f} -> {end_loss:.4f} nats/byte (step {start_step} -> {step}), "
        f"{tokens} tokens, {wall:.0f} s ({tokens / max(train_time, 1e-9):.0f} tokens/s in training)")
    if rank == 0 and args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    from lrmoe_ds.integration import shutdown
    shutdown()  # barrier, DeepSpeed's leaked CPU all-reduce segment removed, process group destroyed


if __name__ == "__main__":
    sys.exit(main())
