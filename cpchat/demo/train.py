"""Train the built-in demo model (run by hand, not by CI).

    python -m cpchat.demo.train --out assets/demo-model

A small llama learns to answer questions about an attached document from
generated examples (cpchat.demo.prose_examples: facts about open-ended names in real
prose, and some synthetic documents), with loss on the answer tokens. Learn to
copy first (`--p-copy 1.0` on short rows): retrieval is built from copy
(induction) heads, and they form far sooner on plain copying than inside the
task; then continue (`--init`) on the questions. The model card in
assets/demo-model has the exact phases.
Training runs in PyTorch on the CPU (faster per step than MLX there; `pip
install torch`, not a dependency of cpchat) and the result is saved as an
mlx-lm model directory.

Length generalisation: retrieval must work far past the training length, so
(1) rope_theta is large, leaving most rotary frequencies nearly still,
(2) some batches use skipped position ids (PoSE): position jumps at sentence
boundaries inside the document, so relative distances up to `--pos-span` are
seen while sequences stay short, and (3) `--attention-temp` trains with
softened attention, so that at inference the match to the fact stands out
among more sentences than training ever showed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cpchat.demo.data import make_example
from cpchat.demo.llama import Llama, deepened
from cpchat.demo.prose_examples import make_prose_example, tokenizer_corpus
from cpchat.prompt import render_document
from cpchat.smallmodels import EOS_TOKEN, SPECIAL_TOKENS, model_config, train_tokenizer, vocab_size_index


# ---------------------------------------------------------------- data
@dataclass(frozen=True)
class Sizes:
    """How much text makes a token, measured with the tokenizer: documents are sized by it."""

    tokens_per_sentence: float  # synthetic grammar sentences
    chars_per_token: float  # real prose


class Encoder:
    """Turns an Example into token ids, a loss mask (answer tokens) and gap points for PoSE."""

    def __init__(self, tokenizer_path: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_path))

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def pieces(self, ex) -> list[tuple[str, int]]:
        """(text, kind) pieces whose encodings concatenate to the encoding of the chat text.

        kind: 0 prompt, 1 answer (loss), 2 document sentence (a position gap may precede it).
        """
        out: list[tuple[str, int]] = []
        for i, (question, answer) in enumerate(ex.turns):
            out.append(("<|im_start|>user\n", 0))
            if i == 0:
                head = render_document(ex.doc_name, "\x00").split("\x00")[0]
                out.append((head, 0))
                out += [(s, 2) for s in ex.sentences]
                out.append(("\n</document>\n\n", 0))
            out.append((f"{question}<|im_end|>\n<|im_start|>assistant\n", 0))
            out.append((f"{answer}{EOS_TOKEN}", 1))
            out.append(("\n", 0))
        return out[:-1]

    def encode(self, ex) -> tuple[list[int], list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        gaps: list[int] = []  # token indices where a position jump is allowed
        for text, kind in self.pieces(ex):
            t = self.ids(text)
            if kind == 2:
                gaps.append(len(ids))
            ids += t
            mask += [1 if kind == 1 else 0] * len(t)
        return ids, mask, gaps

    def check(self, ex) -> None:
        from jinja2 import Template

        from cpchat.smallmodels import CHAT_TEMPLATE

        text = Template(CHAT_TEMPLATE).render(messages=ex.messages(), add_generation_prompt=False)
        assert self.ids(text.rstrip("\n")) == self.encode(ex)[0], "piecewise encoding differs"


def make_batch(rng: random.Random, enc: Encoder, n_tokens: int, max_len: int, pos_span: int,
               p_pose: float, sizes: Sizes, max_questions: int = 4, max_facts: int = 6,
               min_len: int = 96, p_copy: float = 0.0, p_absent: float = 0.15, p_synthetic: float = 0.0):
    """A batch of examples of similar length, about `n_tokens` tokens in all.

    A question-answering row is a document of training-pool prose with facts about open-ended
    names, or with probability `p_synthetic` one of the synthetic grammar documents.
    With probability `p_copy` a row is instead a random token string said twice, with loss on
    the repeat: the plainest signal for the copy (induction) heads retrieval is built from.
    """
    target = int(math.exp(rng.uniform(math.log(min(min_len, max_len)), math.log(max_len))))
    bsz = max(1, n_tokens // target)
    seqs = []
    for _ in range(bsz):
        if rng.random() < p_copy:
            seqs.append((*copy_row(rng, enc, target), False))
            continue
        n_facts = rng.randint(1, max(1, min(max_facts, target // 50)))  # ~50 tokens a fact and its question
        synthetic = rng.random() < p_synthetic
        while True:
            # the document holds the facts too: size the filler so that at least the first answer fits
            share = rng.uniform(0.7, 1.0) * target
            n_questions = rng.randint(1, min(max_questions, n_facts + 1))  # few repeated questions
            if synthetic:
                n_filler = max(1, int(share / sizes.tokens_per_sentence) - 8 - n_facts)
                ex = make_example(rng, n_filler, n_facts=n_facts, n_questions=n_questions, p_absent=p_absent)
            else:
                n_chars = max(40, int((share - 60 - 25 * n_facts) * sizes.chars_per_token))
                ex = make_prose_example(rng, "train", n_chars, n_facts=n_facts, n_questions=n_questions,
                                        p_absent=p_absent)
            ids, mask, gaps = enc.encode(ex)
            ends = [i + 1 for i in range(min(len(ids), max_len))
                    if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
            if ends or n_facts == 1:
                break
            n_facts = max(1, n_facts // 2)
        # keep whole answers only (a cut answer would count as unsolved in the exact-match figure)
        cut = ends[-1] if ends else max_len
        ids, mask = ids[:cut], mask[:cut]
        pos = np.arange(len(ids))
        if rng.random() < p_pose and gaps:
            extra = rng.randint(0, max(0, pos_span - len(ids)))
            cuts = sorted(rng.sample(gaps, min(len(gaps), rng.randint(1, 4))))
            shares = np.random.default_rng(rng.randrange(1 << 30)).dirichlet(np.ones(len(cuts))) * extra
            for c, s in zip(cuts, shares):
                pos[c:] += int(s)
        seqs.append((ids, mask, pos, True))
    t = max(len(s[0]) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t)
    pos = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, (a, m, p, _) in enumerate(seqs):
        ids[i, :len(a)] = torch.tensor(a)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float)
        pos[i, :len(p)] = torch.tensor(p)
        pos[i, len(p):] = int(p[-1]) + 1 + torch.arange(t - len(p))
    lengths = torch.tensor([len(s[0]) for s in seqs])
    return ids, mask, pos, torch.tensor([s[3] for s in seqs]), lengths


def copy_row(rng: random.Random, enc: Encoder, length: int):
    """Random ordinary tokens, then the same tokens again; loss on the second copy."""
    half = [rng.randrange(len(SPECIAL_TOKENS), enc.tok.get_vocab_size()) for _ in range(max(4, length // 2))]
    mask = [0] * (len(half) + 1) + [1] * (len(half) - 1)
    return half + half, mask, np.arange(2 * len(half))


def loss_and_match(model: Llama, ids, mask, pos, qa, lengths, context_weight: float = 0.0, temp: float = 1.0):
    """The training objective, the mean answer-token loss of the question-answering rows, and
    their exact match of the teacher-forced argmax.

    The objective is the mean loss over the masked (answer) tokens plus `context_weight` times
    the mean loss over every other real token (a denser signal; in practice it also taught the
    model to write prose after its answer, see the model card).
    Every answer token being the argmax on the gold path is exactly greedy decoding's success.
    """
    logits = model(ids[:, :-1], pos[:, :-1], temp).float()
    tgt, m = ids[:, 1:], mask[:, 1:]
    nll = F.cross_entropy(logits.transpose(1, 2), tgt, reduction="none")
    loss = (nll * m).sum() / m.sum()
    if context_weight:
        real = (torch.arange(tgt.shape[1])[None] < (lengths[:, None] - 1)).float() * (1 - m)
        loss = loss + context_weight * (nll * real).sum() / real.sum().clamp(min=1)
    m_qa = m * qa[:, None]
    qa_loss = (nll * m_qa).sum() / m_qa.sum().clamp(min=1)
    m_copy = m - m_qa
    copy_loss = (nll * m_copy).sum() / m_copy.sum().clamp(min=1)
    wrong = ((logits.argmax(-1) != tgt).float() * m).sum(1)
    return loss, qa_loss, copy_loss, (wrong == 0).float()[(m_qa.sum(1) > 0)]


# ---------------------------------------------------------------- saving
def save(model: Llama, tok_dir: Path, out: Path, meta: dict) -> None:
    """Write an mlx-lm model directory (atomically replacing `out`)."""
    import mlx.core as mx

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, tmp / name)
    weights = {k: mx.array(v.detach().float().numpy()) for k, v in model.state_dict().items()}
    if not all(mx.isfinite(w).all().item() for w in weights.values()):
        raise SystemExit(f"not saving {out}: the weights are not finite")
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(model.cfg, indent=2))
    (tmp / "training.json").write_text(json.dumps(meta, indent=2))
    readme = out / "README.md"
    if readme.exists():
        shutil.copy(readme, tmp / "README.md")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("assets/demo-model"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=1024, help="longest training sequence (tokens)")
    ap.add_argument("--pos-span", type=int, default=32768, help="largest position id seen (PoSE)")
    ap.add_argument("--p-pose", type=float, default=0.5)
    ap.add_argument("--vocab", type=int, default=1536)
    ap.add_argument("--digit-group", type=int, default=2, help="most digits in one token (train_tokenizer)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ff", type=int, default=512)
    ap.add_argument("--tie", type=int, default=1,
                    help="tie the output head to the embeddings (copying a token is then the identity map)")
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--bf16", type=int, default=1, help="bfloat16 autocast (2x faster on the CPU)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--init", type=Path, help="continue from this saved model directory (weights, tokenizer)")
    ap.add_argument("--start-step", type=int, default=0, help="with --init: the step it was saved at")
    ap.add_argument("--adaptive-cap", type=int, default=0,
                    help="adaptive curriculum from this longest length, x1.25 whenever batches are solved")
    ap.add_argument("--max-questions", type=int, default=4, help="questions per document, 1 to this")
    ap.add_argument("--max-facts", type=int, default=6, help="facts per document, 1 to this")
    ap.add_argument("--start-facts", type=int, default=0,
                    help="with --adaptive-cap: start with at most this many facts, doubling when solved")
    ap.add_argument("--min-len", type=int, default=96, help="shortest training sequence (tokens)")
    ap.add_argument("--p-absent", type=float, default=0.15, help="share of questions whose answer is absent")
    ap.add_argument("--p-synthetic", type=float, default=0.0,
                    help="share of question rows from the synthetic grammar documents (the rest: real prose)")
    ap.add_argument("--p-copy", type=float, default=0.0, help="share of rows that train plain copying")
    ap.add_argument("--context-loss", type=float, default=0.0,
                    help="weight of the loss on the document and question tokens (0: answers only)")
    ap.add_argument("--attention-temp", type=float, default=1.0,
                    help="scale attention logits by a random factor in [this, 1]: softer than at "
                         "inference, so the model learns sharper matches (for contexts past training's)")
    ap.add_argument("--stop-after", type=int, default=0, help="save and stop after this step (same schedule)")
    ap.add_argument("--time-steps", type=int, default=0, help="only time this many steps, then exit")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed if not args.init else f"{args.seed}-{args.start_step}")
    tok_dir = Path(tempfile.mkdtemp(prefix="cpchat-demo-tokenizer-"))  # copied into every checkpoint
    if args.init:
        tok_dir.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(args.init / name, tok_dir / name)
        vocab = json.loads((args.init / "config.json").read_text())["vocab_size"]
    else:
        vocab = train_tokenizer(tok_dir, args.vocab, tokenizer_corpus(args.seed),
                                digit_group=args.digit_group)
    enc = Encoder(tok_dir / "tokenizer.json")
    check_rng = random.Random(args.seed + 1)
    per_sentence, per_char = [], []
    for _ in range(50):
        ex = make_example(check_rng, 40, n_questions=3)
        enc.check(ex)
        per_sentence.append(sum(len(enc.ids(s)) for s in ex.sentences) / len(ex.sentences))
        ex = make_prose_example(check_rng, "train", 3000, n_questions=3)
        enc.check(ex)
        per_char.append(len(ex.doc_text) / len(enc.ids(ex.doc_text)))
    sizes = Sizes(float(np.mean(per_sentence)), float(np.mean(per_char)))
    print(f"vocab {vocab}, {sizes.tokens_per_sentence:.1f} tokens per synthetic sentence, "
          f"{sizes.chars_per_token:.2f} characters per token of prose", flush=True)

    cfg = model_config("llama", vocab, args.hidden, args.layers, args.heads, args.kv_heads, args.ff,
                       tie_embeddings=bool(args.tie), rope_theta=args.rope_theta)
    cfg["eos_token_id"] = vocab_size_index(tok_dir, EOS_TOKEN)
    model = Llama(cfg)
    if args.init:
        import mlx.core as mx

        saved = mx.load(str(args.init / "model.safetensors"))
        weights = {k: torch.tensor(np.array(v)) for k, v in saved.items()}
        model.load_state_dict(deepened(weights, model))
        print(f"continuing from {args.init} at step {args.start_step}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    warmup = min(200, args.steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        if args.init and step < args.start_step + 30:  # fresh optimizer state: a short re-warmup
            return lr_at(args.start_step + 30) * (step - args.start_step + 1) / 30
        progress = (step - warmup) / (args.steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    t0 = time.time()
    hist_loss: list[float] = []
    hist_em: list[float] = []
    hist_all: list[float] = []
    hist_copy: list[float] = []
    cap = args.adaptive_cap
    facts = args.start_facts or args.max_facts
    for step in range(args.start_step, args.steps):
        if not args.adaptive_cap:
            # curriculum: the longest sequence grows from 192 tokens to max_len over the first 40% of steps
            cap = int(min(args.max_len, 192 + (args.max_len - 192) * step / (0.4 * args.steps)))
        elif (step - args.start_step) % 25 == 0 and len(hist_em) >= 25 and np.mean(hist_em[-25:]) >= 0.5:
            # adaptive: harder only once the current level is solved; first more facts, then longer
            if facts < args.max_facts:
                facts = min(args.max_facts, 2 * facts)
            else:
                cap = min(args.max_len, int(cap * 1.25))
            hist_em.clear()
        ids, mask, pos, qa, lengths = make_batch(rng, enc, args.batch_tokens, cap, args.pos_span,
                                                 args.p_pose, sizes, args.max_questions, facts,
                                                 args.min_len, args.p_copy, args.p_absent, args.p_synthetic)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        # no draw at 1.0: the data stream, and so the earlier phases, stay reproducible
        temp = rng.uniform(args.attention_temp, 1.0) if args.attention_temp < 1 else 1.0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.bf16)):
            loss, qa_loss, copy_loss, em = loss_and_match(model, ids, mask, pos, qa, lengths,
                                                          args.context_loss, temp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if torch.isfinite(loss) and torch.isfinite(norm):
            opt.step()
            hist_loss.append(qa_loss.item())
            hist_all.append(loss.item())
            if not qa.all():
                hist_copy.append(copy_loss.item())
            if em.numel():
                hist_em.append(em.mean().item())
        else:  # a bfloat16 overflow once turned a whole run to NaN: drop the step, keep the weights
            print(f"step {step + 1}: loss or gradient not finite, step skipped", flush=True)
        if args.time_steps and step + 1 - args.start_step >= args.time_steps:
            print(f"{(time.time() - t0) / (step + 1 - args.start_step):.3f} s/step at cap {cap}", flush=True)
            return
        if (step + 1) % 25 == 0:
            print(f"step {step + 1} cap {cap} facts {facts} loss {np.mean(hist_loss[-25:]):.4f} "
                  f"objective {np.mean(hist_all[-25:]):.4f} copy {np.mean(hist_copy[-25:] or [0]):.3f} "
                  f"em {np.mean(hist_em[-25:] or [0]):.3f} lr {lr_at(step):.2e} {time.time() - t0:.0f}s",
                  flush=True)
        last = step + 1 == args.steps or step + 1 == args.stop_after
        if (step + 1) % args.save_every == 0 or last:
            meta = {"args": {k: str(v) for k, v in vars(args).items()}, "step": step + 1,
                    "seconds": round(time.time() - t0), "parameters": n_params,
                    "train_em_last100": float(np.mean(hist_em[-100:] or [0]))}
            if args.init and (args.init / "training.json").exists():  # the phases before this one
                meta["continued_from"] = json.loads((args.init / "training.json").read_text())
            save(model, tok_dir, args.out, meta)
            print(f"saved {args.out} at step {step + 1}", flush=True)
        if last:
            break
    print(f"done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
