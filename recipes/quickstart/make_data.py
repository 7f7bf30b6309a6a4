"""Makes the quickstart's corpus and tokenizer (run once; the outputs are committed):

    python recipes/quickstart/make_data.py

``data/stories.txt``: 4,000 short sentences drawn from a small grammar by a seeded generator
(one document per line), text a tiny model learns within a minute. ``models/tiny-qwen3/``:
a byte-level BPE tokenizer of at most 512 tokens (448: the merges this text has) trained on it (``<|endoftext|>`` ends each
document when the trainer packs them), saved as transformers saves one, beside the model's
``config.json``. Both are deterministic: running this again writes the same bytes.
"""

import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 512
SENTENCES = 4000
NAMES = ["the fox", "a small dog", "the old cat", "my sister", "the farmer", "a tired bird", "the teacher", "our cook"]
VERBS = ["found", "carried", "painted", "watched", "lost", "cleaned", "opened", "shared"]
THINGS = ["a red box", "the green door", "an old map", "a warm loaf", "the blue kite", "a heavy stone",
          "the last apple", "a tiny key"]
PLACES = ["near the river", "in the garden", "by the window", "under the bridge", "at the market",
          "behind the barn", "on the hill", "in the kitchen"]
TIMES = ["in the morning", "after the rain", "before dinner", "at night", "on monday", "last summer"]


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        who, verb, what, where = rng.choice(NAMES), rng.choice(VERBS), rng.choice(THINGS), rng.choice(PLACES)
        when = f" {rng.choice(TIMES)}" if rng.random() < 0.5 else ""
        tail = f", and then {rng.choice(NAMES)} {rng.choice(VERBS)} it too" if rng.random() < 0.3 else ""
        out.append(f"{who} {verb} {what} {where}{when}{tail}.".capitalize())
    return out


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = sentences(SENTENCES)
    (HERE / "data").mkdir(exist_ok=True)
    (HERE / "data" / "stories.txt").write_text("\n".join(lines) + "\n")
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(lines, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                            model_max_length=512).save_pretrained(HERE / "models" / "tiny-qwen3")


if __name__ == "__main__":
    main()
