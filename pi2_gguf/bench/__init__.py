"""Measurements: decode speed against stock llama.cpp (in RAM and under a cgroup memory limit) and perplexity."""

# the prompt every decode benchmark uses
PROMPT = ("Write a Python function that parses a CSV file of sales records and returns the total "
          "revenue per region, then explain how it handles malformed lines.")


def heldout_text(n_tokens: int) -> str:
    """Held-out documents of the default calibration corpus (those convert profiles none of), enough text for
    n_tokens decode steps: what a teacher-forced decode evaluates (--decode text), so routing and neuron use follow
    real text where a synthetic model's own greedy output repeats one token."""
    from ..assets import corpus

    text, docs = "", corpus.load(None).split()[1]
    for doc in docs:
        if len(text) >= 8 * n_tokens + 256:  # ~4 characters a token, twice over
            break
        text += ("\n\n" if text else "") + doc
    return text
