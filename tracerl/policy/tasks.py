"""Learnable tasks with verifiable rewards computed from token ids, for RL of the tiny random-init models.

Nothing is downloaded and nothing is tokenized: a task owns a small block of token ids and its reward is a pure
function of the prompt's and the response's ids. Token layout (every task)::

    0 = BOS, 1 = SEP, 2 .. 2 + alphabet - 1 = the task's alphabet        (vocab_size = alphabet + 2)
    prompt   = [BOS, x_1, ..., x_L, SEP]        x_i drawn from the alphabet (seeded)
    response = the model's next `response_len` tokens

A model whose vocabulary is exactly `Task.vocab_size` (``TinyMoESpec(vocab_size=task.vocab_size)``) samples
only ids the task knows, which is what makes the reward rise within minutes on a CPU: a random-init policy
already hits the alphabet, and the gradient only has to sharpen it. A larger vocabulary works too (ids outside
the alphabet score 0) but learns more slowly.

Tasks (`TASKS`):

* ``copy`` (`CopyTask`): repeat the prompt: token reward 1 where response[i] == x_{i+1}. Needs attention to
  the right prompt position (an induction-head-like circuit); chance level 1/alphabet.
* ``target-set`` (`TargetSetTask`): emit tokens of a target set: token reward 1 where response[i] is in the
  set. The set is fixed (``target``, a subset of the alphabet: learnable without reading the prompt) or, with
  ``target="prompt"``, the prompt's own tokens (the policy must read the prompt). Chance level |set|/alphabet.

The trajectory reward is the mean of the token rewards over ``response_len`` positions (missing positions of a
short response score 0, tokens past ``response_len`` are ignored), so it lies in [0, 1].
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import numpy as np

from tracerl.errors import ConfigError

BOS = 0
SEP = 1
FIRST = 2  # first alphabet id


@dataclasses.dataclass(frozen=True)
class Reward:
    """A response's reward: ``reward`` in [0, 1] and one 0/1 ``token_rewards`` entry per scored position."""

    reward: float
    token_rewards: tuple[float, ...]


class Task(abc.ABC):
    """A prompt generator and a reward function on token ids."""

    name: str = ""

    def __init__(self, *, alphabet: int, prompt_len: int, response_len: int):
        if alphabet < 2:
            raise ConfigError(f"alphabet={alphabet}: a task needs at least 2 symbols")
        if prompt_len < 1 or response_len < 1:
            raise ConfigError(f"prompt_len={prompt_len}, response_len={response_len}: both must be >= 1")
        self.alphabet = int(alphabet)
        self.prompt_len = int(prompt_len)
        self.response_len = int(response_len)

    @property
    def vocab_size(self) -> int:
        """The smallest model vocabulary that holds every id of the task (BOS, SEP, the alphabet)."""
        return FIRST + self.alphabet

    @property
    def prompt_tokens(self) -> int:
        """Length of every prompt: BOS, ``prompt_len`` symbols, SEP."""
        return self.prompt_len + 2

    def config(self) -> dict:
        """JSON-ready description (name and constructor arguments) that `make_task` rebuilds the task from."""
        return {"name": self.name, "alphabet": self.alphabet, "prompt_len": self.prompt_len,
                "response_len": self.response_len}

    def _symbols(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n, prompt_len] int64 alphabet ids; tasks override this to shape prompts."""
        return rng.integers(FIRST, FIRST + self.alphabet, size=(n, self.prompt_len), dtype=np.int64)

    def prompts(self, n: int, seed: int) -> list[list[int]]:
        """``n`` prompts of `prompt_tokens` ids each, a pure function of ``(n, seed)`` (numpy PCG64): the first
        k prompts of a seed are the same whatever n is."""
        if n < 0:
            raise ConfigError(f"n={n} prompts: must be >= 0")
        body = self._symbols(np.random.default_rng(seed), n)
        return [[BOS, *row.tolist(), SEP] for row in body]

    def _check_prompt(self, prompt: Sequence[int]) -> list[int]:
        p = [int(t) for t in prompt]
        sym = p[1:-1]
        if (len(p) != self.prompt_tokens or p[0] != BOS or p[-1] != SEP
                or any(not FIRST <= t < FIRST + self.alphabet for t in sym)):
            raise ConfigError(f"{self.name}: not a prompt of this task: {p[:12]}{'...' if len(p) > 12 else ''}; "
                              f"expected [{BOS}, {self.prompt_len} ids in [{FIRST}, {FIRST + self.alphabet}), {SEP}]")
        return sym

    @abc.abstractmethod
    def _token_rewards(self, symbols: list[int], response: list[int]) -> list[float]:
        """0/1 per position of ``response`` (at most ``response_len`` long)."""

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> Reward:
        """Score ``response`` (generated ids after ``prompt``).

        Raises:
            ConfigError: ``prompt`` is not a prompt of this task (length, BOS/SEP, ids outside the alphabet).
        """
        sym = self._check_prompt(prompt)
        resp = [int(t) for t in response[: self.response_len]]
        tok = self._token_rewards(sym, resp)
        tok += [0.0] * (self.response_len - len(tok))
        return Reward(sum(tok) / self.response_len, tuple(tok))

    def rewards(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[Reward]:
        """`reward` of each (prompt, response) pair. Raises ConfigError if the counts differ."""
        if len(prompts) != len(responses):
            raise ConfigError(f"{len(prompts)} prompts but {len(responses)} responses")
        return [self.reward(p, r) for p, r in zip(prompts, responses)]

    @abc.abstractmethod
    def chance(self) -> float:
        """Expected reward of a policy that emits uniform alphabet symbols (the level a random init starts near)."""


class CopyTask(Task):
    """Repeat the prompt's symbols in order: token reward 1 where response[i] == prompt symbol i.

    ``response_len`` defaults to ``prompt_len`` and may not exceed it."""

    name = "copy"

    def __init__(self, *, alphabet: int = 8, prompt_len: int = 4, response_len: int | None = None):
        super().__init__(alphabet=alphabet, prompt_len=prompt_len,
                         response_len=prompt_len if response_len is None else response_len)
        if self.response_len > self.prompt_len:
            raise ConfigError(f"copy: response_len={self.response_len} > prompt_len={self.prompt_len}")

    def _token_rewards(self, symbols: list[int], response: list[int]) -> list[float]:
        return [float(r == s) for r, s in zip(response, symbols)]

    def chance(self) -> float:
        return 1.0 / self.alphabet


class TargetSetTask(Task):
    """Emit tokens of a target set: token reward 1 where the response token is in the set.

    Args:
        target: ``"prompt"`` (the set is the prompt's distinct symbols; default) or a sequence of alphabet
            offsets 0 .. alphabet-1 (a fixed set of ids ``FIRST + offset``, the same for every prompt).
    """

    name = "target-set"

    def __init__(self, *, alphabet: int = 8, prompt_len: int = 3, response_len: int = 8,
                 target: str | Sequence[int] = "prompt"):
        super().__init__(alphabet=alphabet, prompt_len=prompt_len, response_len=response_len)
        if isinstance(target, str):
            if target != "prompt":
                raise ConfigError(f"target-set: target={target!r}; use 'prompt' or a list of alphabet offsets")
            self.target: str | tuple[int, ...] = "prompt"
            if prompt_len > alphabet:
                raise ConfigError(f"target-set: prompt_len={prompt_len} distinct symbols from an alphabet of "
                                  f"{alphabet}")
        else:
            offs = tuple(sorted({int(t) for t in target}))
            if not offs or offs[0] < 0 or offs[-1] >= alphabet:
                raise ConfigError(f"target-set: target offsets {list(target)[:8]} must be a non-empty subset of "
                                  f"0..{alphabet - 1}")
            self.target = offs

    def config(self) -> dict:
        return {**super().config(), "target": self.target if self.target == "prompt" else list(self.target)}

    def _symbols(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.target != "prompt":
            return super()._symbols(rng, n)
        # distinct symbols, so the target set has exactly prompt_len members and chance is prompt_len/alphabet
        keys = rng.random((n, self.alphabet))
        return (np.argsort(keys, axis=1)[:, : self.prompt_len] + FIRST).astype(np.int64)

    def _set(self, symbols: list[int]) -> set[int]:
        return set(symbols) if self.target == "prompt" else {FIRST + o for o in self.target}

    def _check_prompt(self, prompt: Sequence[int]) -> list[int]:
        sym = super()._check_prompt(prompt)
        if self.target == "prompt" and len(set(sym)) != len(sym):
            raise ConfigError(f"target-set: prompt symbols {sym} repeat; this task's prompts hold distinct symbols")
        return sym

    def _token_rewards(self, symbols: list[int], response: list[int]) -> list[float]:
        s = self._set(symbols)
        return [float(r in s) for r in response]

    def chance(self) -> float:
        n = self.prompt_len if self.target == "prompt" else len(self.target)
        return n / self.alphabet


TASKS: dict[str, type[Task]] = {CopyTask.name: CopyTask, TargetSetTask.name: TargetSetTask}


def make_task(name: str, **kwargs) -> Task:
    """The task ``name`` (a key of `TASKS`) built with ``kwargs``; ``make_task(**task.config())`` rebuilds ``task``.

    Raises:
        ConfigError: unknown name or arguments the task does not take / accept.
    """
    cls = TASKS.get(name)
    if cls is None:
        raise ConfigError(f"unknown task {name!r}; supported: {', '.join(TASKS)}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"task {name!r}: {e}") from None
