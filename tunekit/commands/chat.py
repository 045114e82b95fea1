"""`tunekit chat [RUN]`: talk to what you trained, through its chat template, with history, streamed.

RUN is a run folder, an adapter folder or a model folder (tunekit.runs.open); none: the base
(--model or the default model). Every turn renders the whole conversation with the chat template
the run trained with (a prompt-tuning run's soft prompt goes first, as in training), decodes
greedily (or samples with --temperature) and prints the reply token by token. The oldest
exchanges are dropped when the conversation outgrows the model's context.

Lines read from stdin are user messages; `/reset` clears the history, `/exit` (or end of input)
ends. Piped input works the same way, so `printf 'Hi\\nAnd you?\\n' | tunekit chat runs/x` is a
two-turn conversation.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Callable, Optional, TextIO

import torch

from tunekit import TunekitError
from tunekit.commands.parse import Parser, add_device_argument, check_number

log = logging.getLogger("tunekit")
DEFAULT_CONTEXT = 2048  # a model whose config.json names no max_position_embeddings
PLANNED_CONTEXT = 8192  # the longest conversation the memory check plans for


class Streamer:
    """Prints new text as tokens arrive (batch of one). Decoding the whole reply each time keeps
    multi-token characters and tokenizer spacing right; a trailing partial character waits."""

    def __init__(self, tokenizer, stop_ids, out: TextIO):
        self.tokenizer, self.stop, self.out = tokenizer, set(stop_ids), out
        self.ids: list[int] = []
        self.shown = ""

    def __call__(self, tokens: list[int]) -> None:
        if tokens[0] in self.stop:
            return
        self.ids.append(tokens[0])
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).lstrip()
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return
        self.out.write(text[len(self.shown):])
        self.out.flush()
        self.shown = text

    def finish(self) -> str:
        """Print what is left and end the line; returns the reply (stripped) for the history."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).lstrip()
        if text.startswith(self.shown):
            self.out.write(text[len(self.shown):])
        self.out.write("\n")
        self.out.flush()
        return text.strip()


def sampler(temperature: float, top_p: float, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Greedy for temperature 0; else nucleus sampling (Holtzman et al. 2020) at that temperature."""
    if temperature == 0:
        return lambda logits: logits.argmax(-1)
    generators: dict[torch.device, torch.Generator] = {}

    def pick(logits: torch.Tensor) -> torch.Tensor:  # (batch, vocab) -> (batch,)
        # on the logits' device, with a seeded generator of that device: only the chosen token
        # leaves it, not a copy of the vocabulary's logits per token
        gen = generators.setdefault(logits.device, torch.Generator(device=logits.device).manual_seed(seed))
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1, generator=gen)
        return order.gather(-1, choice).squeeze(-1)

    return pick


class Conversation:
    def __init__(self, model, tokenizer, system: Optional[str], max_new_tokens: int, pick, out: TextIO):
        from tunekit.infer.decode import generation_view, pad_token_id, stop_token_ids

        self.lm, self.soft = generation_view(model)
        self.lm.eval()
        self.tokenizer, self.max_new_tokens, self.pick, self.out = tokenizer, max_new_tokens, pick, out
        self.stop, self.pad = stop_token_ids(self.lm, tokenizer), pad_token_id(tokenizer)
        self.system = [{"role": "system", "content": system}] if system else []
        self.history: list[dict] = []
        self.limit = getattr(self.lm.config, "max_position_embeddings", None) or DEFAULT_CONTEXT

    def reset(self) -> None:
        self.history = []

    def _prompt(self) -> list[int]:
        from tunekit.infer.decode import encode_messages

        n_soft = 0 if self.soft is None else self.soft.shape[0]
        while True:
            ids = encode_messages(self.tokenizer, self.system + self.history)
            if len(ids) + n_soft + self.max_new_tokens <= self.limit:
                return ids
            if len(self.history) <= 1:
                self.history = []
                raise TunekitError(f"chat: the message is too long for the model's context ({self.limit} tokens "
                                   f"including --max-new-tokens {self.max_new_tokens})")
            self.history = self.history[2:]  # drop the oldest exchange

    def say(self, text: str) -> str:
        from tunekit.infer.decode import greedy, prefill

        self.history.append({"role": "user", "content": text})
        ids = self._prompt()
        stream = Streamer(self.tokenizer, self.stop, self.out)
        prefix = prefill(self.lm, [ids], [self.soft])
        greedy(self.lm, prefix, self.max_new_tokens, self.stop, self.pad, on_token=stream, pick=self.pick)
        reply = stream.finish()
        self.history.append({"role": "assistant", "content": reply})
        return reply


def check_system_turn(tokenizer, system: str) -> None:
    """Render the system message once before anything loads: some chat templates (Llama-2's) refuse
    a system turn with raise_exception, which would otherwise surface as a template error at the
    first message."""
    from tunekit.infer.decode import encode_messages

    try:
        encode_messages(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}])
    except TunekitError:
        raise
    except Exception as e:  # jinja2's TemplateError (raise_exception) and the template's own failures
        raise TunekitError(f"--system: the tokenizer's chat template refuses a system turn "
                           f"({str(e).splitlines()[0][:160] if str(e) else type(e).__name__})") from None


def chat_workload(src):
    """One conversation of up to PLANNED_CONTEXT tokens, or the model's context if shorter (the
    history is cut to fit that): its cache, one prompt forward of that length, one position's
    logits per new token. Longer conversations on long-context models grow the cache past the check."""
    from tunekit.plan.inference import Workload

    config = Path(src.base_path) / "config.json"
    context = (json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None)
    tokens = min(int(context or DEFAULT_CONTEXT), PLANNED_CONTEXT)
    return Workload(kv_tokens=tokens, forward_tokens=tokens, logit_rows=1)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="tunekit chat",
        description="Talk to what you trained: chat template, streaming, history. /reset clears the history, "
                    "/exit or end of input ends.",
        epilog="example: tunekit chat runs/x   |   printf 'Hi\\n' | tunekit chat runs/x",
    )
    p.add_argument("source", nargs="?", metavar="RUN", help="a run, adapter or model folder (default: the base)")
    p.add_argument("--model", metavar="DIR", help="base model for an adapter folder outside a run, or to chat with")
    p.add_argument("--quantize", choices=["none", "nf4"], help="load an adapter folder's base in 4-bit NF4")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--system", metavar="TEXT", help="a system message at the start of the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus mass when sampling")
    p.add_argument("--seed", type=int, default=0)
    add_device_argument(p)
    return p


def main(argv: list[str], stdin: TextIO | None = None, stdout: TextIO | None = None) -> None:
    from tunekit.device.facts import command_facts
    from tunekit.runs.load import load_tokenizer_for, load_trained
    from tunekit.runs.memory import check_memory
    from tunekit.runs.open import base_source, open_source

    parser = build_parser()
    args = parser.parse_args(argv)
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if args.max_new_tokens <= 0:
        raise TunekitError(f"--max-new-tokens: must be > 0, got {args.max_new_tokens}")
    # NaN or inf turns the sampling probabilities into NaN (torch.multinomial then fails mid-reply);
    # top-p is a probability mass, of which 0 keeps no token
    check_number(parser, "--temperature", args.temperature, ge=0)
    check_number(parser, "--top-p", args.top_p, gt=0, le=1)
    facts = command_facts(args.device)
    src = (open_source(args.source, args.model, args.quantize, args.dtype, facts=facts) if args.source
           else base_source(args.model, args.quantize, args.dtype, facts))
    log.info("%s", check_memory(src, chat_workload(src), "tunekit chat"))
    tokenizer = load_tokenizer_for(src)
    if args.system:
        check_system_turn(tokenizer, args.system)
    chat = Conversation(load_trained(src), tokenizer, args.system, args.max_new_tokens,
                        sampler(args.temperature, args.top_p, args.seed), stdout)
    interactive = stdin.isatty()
    print(f"[tunekit] chatting with {src.describe()}; /reset clears the history, /exit ends", file=sys.stderr)
    while True:
        if interactive:
            stdout.write("you> ")
            stdout.flush()
        try:
            line = stdin.readline()
            # under a C/POSIX locale Python reads stdin with surrogateescape: undecodable bytes come
            # through as lone surrogates, which the tokenizer then rejects with a TypeError
            line.encode("utf-8")
        except UnicodeDecodeError as e:
            raise TunekitError(f"stdin: not UTF-8 text (byte 0x{e.object[e.start]:02x}); chat reads UTF-8 "
                               "messages, one a line") from None
        except UnicodeEncodeError as e:
            code = ord(e.object[e.start])
            byte = f" (byte 0x{code - 0xDC00:02x})" if 0xDC80 <= code <= 0xDCFF else ""
            raise TunekitError(f"stdin: not UTF-8 text{byte}; chat reads UTF-8 messages, one a line") from None
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            chat.reset()
            print("[tunekit] history cleared", file=sys.stderr)
            continue
        if interactive:
            stdout.write("model> ")
        try:
            chat.say(text)
        except TunekitError as e:  # a too-long message ends that turn, not the session
            print(f"tunekit: error: {e}", file=sys.stderr)
    if interactive:
        stdout.write("\n")
