"""kvbench's lm-evaluation-harness model: lm-eval's requests answered from the compressed cache.

Tokenization, left truncation and stop handling mirror lm-eval's ``HFLM``, so with the stack
``none`` the answers equal ``HFLM``'s. What each request type compresses is described in
:mod:`kvbench.eval.lm_eval_bridge`.
"""

from __future__ import annotations

import functools

import torch
from tqdm.auto import tqdm

from kvbench.errors import ConfigError
from kvbench.eval import generate, loop
from kvbench.models import LoadedModel
from kvbench.stack import Stack


@functools.cache
def bridge_class():
    """The ``lm_eval.api.model.TemplateLM`` subclass answering requests through a stack."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class Bridge(TemplateLM):
        def __init__(self, lm: LoadedModel, stack: Stack, ds) -> None:
            super().__init__()
            tok = getattr(lm.codec, "tok", None)
            if tok is None:
                raise ConfigError(
                    f"model {lm.info.get('name')}: the lm-eval bridge needs a transformers tokenizer"
                )
            self.lm, self.stack, self.ds, self.tokenizer = lm, stack, ds, tok
            self.accounting: list[dict] = []  # one entry per request, each its own batch number
            self._batches = 0  # batch numbers handed out so far
            self._docs: list[dict] = []

        # -- tokenization, as lm-eval's HF backend does it --------------------------------------
        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            bos = self.tokenizer.bos_token_id
            return bos if bos is not None else self.tokenizer.eos_token_id

        @property
        def max_length(self) -> int:
            return int(getattr(self.lm.model.config, "max_position_embeddings", 2048))

        @property
        def tokenizer_name(self) -> str:
            return str(self.tokenizer.name_or_path).replace("/", "__")

        def _special(self, string: str, add_special_tokens: bool | None) -> dict:
            if add_special_tokens is not None:
                return {"add_special_tokens": add_special_tokens}
            if string.startswith(self.tokenizer.decode(self.prefix_token_id)):
                return {"add_special_tokens": False}  # the text carries its BOS already
            return {}

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return self.tokenizer.encode(string, **self._special(string, add_special_tokens))

        def tok_decode(self, tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

        def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
            return self.tokenizer.apply_chat_template(
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
            )

        def _context_end(self, prompt: str, doc: dict) -> int | None:
            """Characters of ``prompt`` up to the end of the document's context, if it has one."""
            context = doc.get("context") if isinstance(doc, dict) else None
            if not isinstance(context, str) or not context or context not in prompt:
                return None
            return prompt.rfind(context) + len(context)

        def _encode_with_cut(self, prompt: str, doc: dict) -> tuple[list[int], int | None]:
            """``tok_encode(prompt)`` and how many of its tokens lie before the context's end."""
            cut = self._context_end(prompt, doc)
            if cut is None:
                return self.tok_encode(prompt), None
            enc = self.tokenizer(prompt, return_offsets_mapping=True, **self._special(prompt, None))
            return list(enc.input_ids), sum(1 for start, _ in enc.offset_mapping if start < cut)

        def _head_length(self, n_prompt: int, context_tokens: int | None) -> int:
            """Tokens of a prompt prefilled and compressed; the rest is protected."""
            if context_tokens is not None:
                return min(context_tokens, n_prompt)
            return max(0, n_prompt - int(self.ds.protected_tail))

        def _next_batch(self) -> int:
            self._batches += 1
            return self._batches - 1

        # -- loglikelihood ----------------------------------------------------------------------
        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            self._docs = [r.doc for r in requests]
            return super().loglikelihood(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            out = []
            for i, ((context, _), context_enc, continuation_enc) in enumerate(
                tqdm(requests, desc="loglikelihood requests", leave=False, disable=None)
            ):
                whole = (context_enc + continuation_enc)[-(self.max_length + 1) :]
                inputs, n = whole[:-1], len(continuation_enc)
                dropped = len(context_enc) + len(continuation_enc) - len(whole)
                context_tokens = None
                if context:
                    _, cut = self._encode_with_cut(context.rstrip(), self._docs[i])
                    context_tokens = None if cut is None else max(0, cut - dropped)
                n_context = len(inputs) - (n - 1)  # context tokens among the inputs
                # the context's last token goes with the continuation: every continuation token
                # is scored against the compressed cache
                head = self._head_length(n_context - 1, context_tokens)
                logprobs = self._score(inputs, n, head)
                target = torch.tensor(continuation_enc)
                greedy = bool((logprobs.argmax(-1) == target).all())
                out.append((float(logprobs.gather(-1, target[:, None]).sum()), greedy))
            return out

        def _score(
            self, inputs: list[int], n: int, head: int | None, chunk: int | None = None
        ) -> torch.Tensor:
            """Log-probs ``(n, V)`` at the last ``n`` positions of ``inputs``.

            With ``head``, the first ``head`` tokens are prefilled and compressed and the rest is
            fed after, never evicted; without, ``inputs`` go in ``chunk``-token steps, the stack
            applied after each (nothing protected).
            """
            cache = loop.new_cache(self.lm, self.stack)
            if head is not None:
                for store in cache.stores:
                    store.set_protect_from(head)
                parts = [inputs[:head], inputs[head:]]
            else:
                size = chunk or len(inputs)
                parts = [inputs[at : at + size] for at in range(0, len(inputs), size)]
            times: list[float] = []
            pieces, ref, stored, resident = [], 0, 0, 0
            after = len(inputs)  # tokens from this part's start on
            for part in filter(None, parts):
                after -= len(part)  # now: tokens after this part
                # the lm head runs only over the part's positions among the last n
                pieces.append(loop.step(self.lm, cache, part, times, keep=max(0, n - after)))
                if len(pieces) == 1:  # the prefill: what it stored
                    ref, stored = cache.reference_bytes(), cache.nbytes()
                resident = max(resident, cache.resident_bytes())
            scored = generate.Generated(
                [],
                self._next_batch(),
                sum(times),
                [],
                stored,
                ref,
                cache.nbytes(),
                cache.reference_bytes(),
                resident,
            )
            self.accounting.append({**scored.accounting(), "generated": False})
            return torch.log_softmax(torch.cat(pieces)[-n:], dim=-1).cpu()

        # -- loglikelihood_rolling: compression-aware perplexity --------------------------------
        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            out = []
            chunk = int(self.ds.chunk)
            for (string,) in tqdm(
                [r.args for r in requests], desc="rolling requests", leave=False, disable=None
            ):
                total = 0.0
                for context, continuation in map(
                    make_disjoint_window,
                    get_rolling_token_windows(
                        token_list=self.tok_encode(string),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    ),
                ):
                    inputs = (context + continuation)[:-1]
                    logprobs = self._score(inputs, len(continuation), None, chunk)
                    target = torch.tensor(continuation)
                    total += float(logprobs.gather(-1, target[:, None]).sum())
                out.append(total)
            return out

        # -- generate_until ---------------------------------------------------------------------
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            eos = self.tokenizer.decode(self.eot_token_id)
            prompts, stops = [], []
            for r in requests:
                prompt, gen_kwargs = r.args
                kwargs = normalize_gen_kwargs(gen_kwargs, 256)
                if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
                    raise ConfigError(
                        f"lm-eval task {r.task_name}: asks for sampling ({gen_kwargs}); the bridge decodes "
                        "greedily; allowed do_sample=false, temperature=0"
                    )
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_new = int(kwargs.pop("max_gen_toks"))
                ids, context_tokens = self._encode_with_cut(prompt, r.doc)
                keep = self.max_length - max_new  # lm-eval's left truncation of the prompt
                if keep <= 0:
                    raise ConfigError(
                        f"lm-eval task {r.task_name}: max_gen_toks={max_new} leaves no room in the model's "
                        f"context ({self.max_length})"
                    )
                dropped = max(0, len(ids) - keep)
                ids = ids[dropped:]
                if context_tokens is not None:
                    context_tokens = max(0, context_tokens - dropped)
                head = min(self._head_length(len(ids), context_tokens), len(ids) - 1)
                done = functools.partial(_stopped, self.tokenizer, until)
                prompts.append(generate.Prompt(ids[:head], ids[head:], max_new, done))
                stops.append(until)
            first = self._batches
            gens = generate.generate(
                self.lm,
                self.stack,
                prompts,
                int(self.ds.batch_size),
                bool(self.ds.query_aware),
                desc="generate_until",
            )
            self._batches += gens[-1].batch + 1 if gens else 0
            texts = []
            for g, until in zip(gens, stops):
                account = g.accounting()
                self.accounting.append({**account, "batch": account["batch"] + first, "generated": True})
                texts.append(postprocess_generated_text(self.tok_decode(g.tokens), until, None))
            return texts

    return Bridge


def _stopped(tokenizer, until: list[str], tokens: list[int]) -> bool:
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return any(u and u in text for u in until)
