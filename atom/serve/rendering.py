"""What a generation request sends back: text with stop strings applied, per-choice state,
token strings and bytes, logprobs in the completions and chat shapes, usage."""

from __future__ import annotations

from dataclasses import dataclass

from atom.serve.engine_loop import Delta, RequestStream
from atom.tokenizer import ByteTokenizer, Tokenizer


class _Stopper:
    """Applies stop strings to the decoded text, holding back what could start one."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def feed(self, ids: list[int], final: bool) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        for s in self.stops:
            at = text.find(s)
            if at >= 0:
                text, final, self.stopped = text[:at], True, True
        limit = len(text) if final else max(self.sent, len(text) - self.hold)
        if not final:
            while limit > self.sent and text[limit - 1] == "\ufffd":  # an unfinished utf-8
                limit -= 1
        out, self.sent = text[self.sent : limit], max(self.sent, limit)
        return out


LOGPROB_FLOOR = -9999.0  # what JSON carries for -inf (as vLLM)


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


@dataclass(eq=False)
class _Choice:
    """One of a request's ``n`` choices: its engine request and what was sent of it."""

    index: int
    rid: str
    stream: RequestStream
    stopper: _Stopper
    delta: Delta | None = None  # the last delta read
    reason: str | None = None  # the finish reason, once it ended
    offset: int = 0  # completions' text_offset of the next token reported
    prompt: int = 0  # which of the request's prompts it continues


class _Output:
    """A request's text and logprobs as OpenAI's shapes: the echoed prompt, each generated
    token's logprob and alternatives (the engine records them before the token is visible,
    so ``seq.logprobs`` covers every token a delta carries)."""

    def __init__(
        self, tokenizer: Tokenizer, body, chat: bool, prompts: list[tuple[list[int], str | None]]
    ):
        self.tok = tokenizer
        self.k, _ = body._logprobs()
        self.want = self.k is not None
        self.echo_only = body.echo_only
        self.prompt_ids = [ids for ids, _ in prompts]
        echo = not chat and body.echo
        self.echo_texts = [
            (text if text is not None else tokenizer.decode(ids)) if echo else ""
            for ids, text in prompts
        ]
        self._strs: dict[int, str] = {}

    def token_str(self, t: int) -> str:
        s = self._strs.get(t)
        if s is None:
            s = self._strs[t] = self.tok.decode([t])
        return s

    def token_bytes(self, t: int) -> list[int]:
        if isinstance(self.tok, ByteTokenizer):
            return [t] if 0 <= t < 256 else []
        return list(self.token_str(t).encode("utf-8"))

    def take(self, c: _Choice, delta: Delta) -> tuple[str, list]:
        """A delta's new text (after stop strings) and its tokens' (id, TokenLogprob)."""
        if self.echo_only:
            return "", []  # the one token sampled is not returned
        done = len(c.stopper.ids)
        text = c.stopper.feed(delta.token_ids, delta.finished)
        if not (self.want and delta.token_ids):
            return text, []
        seq = delta.seq or c.stream.seq
        return text, [(r.token_id, r) for r in seq.logprobs[done : done + len(delta.token_ids)]]

    def completion_tokens(self, c: _Choice) -> int:
        return 0 if self.echo_only else len(c.stopper.ids)

    def echo(self, c: _Choice) -> tuple[str, list]:
        """The echoed prompt (the choice's own) and, with logprobs, its tokens' (id,
        TokenLogprob | None)."""
        text = self.echo_texts[c.prompt]
        if not self.want or not text:
            return text, []
        seq = c.stream.seq or c.delta.seq
        recs = [None, *seq.prompt_logprobs]
        return text, list(zip(self.prompt_ids[c.prompt], recs))

    def completion_logprobs(self, c: _Choice, entries: list) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for tid, rec in entries:
            s = self.token_str(tid)
            tokens.append(s)
            offsets.append(c.offset)
            c.offset += len(s)
            if rec is None:  # the first prompt token: nothing predicts it
                values.append(None)
                tops.append(None)
                continue
            values.append(_lp(rec.logprob))
            top = {self.token_str(t): _lp(v) for t, v in rec.top}
            top.setdefault(s, _lp(rec.logprob))  # the chosen token is always there
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def final_choice(self, c: _Choice, text: str, logprobs: list, chat: bool) -> dict:
        """A finished choice of a non-streamed response, in the chat or completions shape."""
        if chat:
            lps = self.chat_logprobs(logprobs) if self.want else None
            message = {"role": "assistant", "content": text}
            return {
                "index": c.index,
                "message": message,
                "logprobs": lps,
                "finish_reason": c.reason,
            }
        echo, echo_lps = self.echo(c)
        lps = self.completion_logprobs(c, echo_lps + logprobs) if self.want else None
        return {"index": c.index, "text": echo + text, "logprobs": lps, "finish_reason": c.reason}

    def chat_logprobs(self, entries: list) -> dict:
        def item(t: int, v: float) -> dict:
            return {"token": self.token_str(t), "logprob": _lp(v), "bytes": self.token_bytes(t)}

        content = []
        for tid, rec in entries:
            entry = item(tid, rec.logprob)
            entry["top_logprobs"] = [item(t, v) for t, v in rec.top]
            content.append(entry)
        return {"content": content}


def _usage(seqs, completion_tokens: int) -> dict:
    """OpenAI's usage of a request: its prompts' tokens (one sequence per prompt, or one
    sequence) and the completion tokens of every choice."""
    counters = [s.counters for s in (seqs if isinstance(seqs, list) else [seqs])]

    def total(name: str) -> int:
        return sum(getattr(c, name) for c in counters)

    prompt = total("prompt_tokens")
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": total("hbm_hit_tokens") + total("tier_hit_tokens"),
            "hbm_tokens": total("hbm_hit_tokens"),
            "tier_tokens": total("tier_hit_tokens"),
            "computed_tokens": total("computed_prompt_tokens"),
        },
    }


def _prompt_seqs(choices: list[_Choice], n: int) -> list:
    """One engine sequence per prompt (its first choice's), for the usage."""
    return [c.stream.seq or c.delta.seq for c in choices[::n]]
