"""How much prompt work a step may take, from what steps have cost: the step budget is time, not tokens.

Decoding sequences get a token every step, so a step's length is the gap between their tokens. The prompt work
that rides along (prompt chunks, embedding inputs) is sized from the cost of the last steps that did prompt work,
fitted as a fixed part (the decode rows, the step's overhead) plus a part a prompt token, and kept current (a
token far into a long prompt costs more than one at its start, since its attention reads everything before it;
a machine whose cores other programs take makes every part dearer). A step stays within its target: a short one
while anything decodes or waits for its first token, a longer one (idle_factor times) for a prompt computed alone,
where only throughput counts. Until the recent steps differ in size the two parts cannot be told apart, and every
second is counted against the tokens (an upper bound on a token's cost, so a step that size stays within its
target); the next step's size then differs, and the fit begins.
"""

from collections import deque
from dataclasses import dataclass, field

WINDOW = 12  # the steps with prompt work that the fit reads
MIN_CHUNK = 32  # prompt tokens: below this a step's fixed cost is most of it
# Beside streams a smaller floor: deep in a 30k prompt every token's attention reads all the keys before it, and 32
# tokens took 0.78 s a step on two quiet cores (bench/interactive_load.py), three times the target.
BUSY_MIN_CHUNK = 8


@dataclass
class StepBudget:
    target: float  # seconds a step may take while sequences decode or wait
    first_guess: int  # prompt tokens a busy step takes before steps were measured
    idle_factor: float = 4.0  # a prompt alone: steps this many times longer
    steps: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (prompt tokens, seconds)

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """What one step cost: its wall time, and the prompt tokens it computed."""
        if prompt_tokens:
            self.steps.append((prompt_tokens, seconds))

    def cost(self) -> tuple[float, float] | None:
        """(seconds a step, seconds a prompt token) fitted to the recent steps; None until two differ in size."""
        sizes = [n for n, _ in self.steps]
        if len(sizes) < 2 or max(sizes) < 1.5 * min(sizes):
            return None
        mean_n = sum(sizes) / len(sizes)
        mean_t = sum(t for _, t in self.steps) / len(self.steps)
        var = sum((n - mean_n) ** 2 for n in sizes)
        per_token = sum((n - mean_n) * (t - mean_t) for n, t in self.steps) / var
        if per_token <= 0:  # noise (other programs' load) hid the slope: count every second against the tokens
            return 0.0, mean_t / mean_n
        return min(max(mean_t - per_token * mean_n, 0.0), mean_t), per_token

    def prompt_tokens(self, busy: bool, cap: int) -> int:
        """Prompt tokens for the next step, at most cap: busy when sequences decode or wait for a first token."""
        if not self.steps:
            return min(self.first_guess, cap)
        fitted = self.cost()
        target = self.target if busy else self.target * self.idle_factor
        floor = BUSY_MIN_CHUNK if busy else MIN_CHUNK
        if fitted is None:  # one size so far: as if it all were the tokens'
            tokens, seconds = self.steps[-1]
            size = max(floor, min(cap, round(target / (seconds / tokens))))
            # alone, a prompt takes twice the tokens where that size would repeat, so that the fit can start
            return size if busy or size >= 1.5 * tokens else min(cap, max(size, 2 * tokens))
        fixed, per_token = fitted
        # No further than twice the largest size measured: a fit over small prompt parts beside many decode rows
        # can find a slope near 0 and promise thousands of tokens in a step (a 6.3 s gap beside 48 streams).
        grown = 2 * max(n for n, _ in self.steps)
        return max(floor, min(cap, grown, round((target - fixed) / per_token)))


def fair_share(needs: list[int], tokens: int) -> int:
    """The most tokens each of these prompts may take so that together they take at most `tokens`, a prompt that
    needs less than its equal part leaving the rest to the others (max-min fairness)."""
    left, count = tokens, len(needs)
    for i, need in enumerate(sorted(needs)):
        if need * (count - i) >= left:
            return left // (count - i)
        left -= need
    return max(needs, default=tokens)


def chunk_allowance(need: int, share: int) -> int:
    """The most of a prompt's need it may take this step: all of a short one (at most MIN_CHUNK: it ends in this
    step), else its fair share, at least a token. A floor for long prompts would let the first in line take a
    small step whole, step after step, while a short prompt behind it waited for its end."""
    return need if need <= MIN_CHUNK else min(need, max(1, share))


def max_seqs_per_client(max_num_seqs: int) -> int:
    """The slots one client's running requests may hold: all but a quarter, which stays for other clients."""
    return max(1, max_num_seqs - max_num_seqs // 4)
