"""Train the demo adapter `smollm2-pirate`: SmolLM2-135M-Instruct answering like a pirate.

    .venv/bin/python scripts/train_demo_adapter.py [--out adapter_store/demo_adapters/smollm2-pirate]

How it is made (all on CPU, fp32, seed 0):
- Data: the 32 EXAMPLES below, short questions with plain one-sentence answers of our own (none is
  a question `loraserve up` asks), each answer rewritten by `pirate()`: "Arr, matey! " in front, a
  few words swapped (you -> ye, your -> yer, my -> me, is/are -> be, yes -> aye, hello -> ahoy,
  friend -> matey, money -> doubloons) and " Yo ho ho!" at the end: a style the reader sees at once.
  The conversations are rendered with the model's chat template (its default system prompt
  included, as `up` asks), the loss is the cross-entropy of the assistant's tokens only.
- Model: PEFT LoRA r=8, lora_alpha=16, no dropout, on q/k/v/o_proj and gate/up/down_proj of the
  top 6 decoder layers (TOP_LAYERS) (`layers_to_transform`). The layers below them do not change, so
  their output is computed once per example and the training steps run the top layers only.
- Training: AdamW, lr 3e-3, batches of 4 (a seeded shuffle, epoch after epoch), 24 steps; the LoRA
  weights are saved in float16 (adapter_model.safetensors, 1 MB).
- Time: about 2 minutes on a busy 2-core machine (`--threads 1`), a quarter of it for the frozen
  layers' output.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch

# (question, plain answer) pairs of our own; pirate() rewrites each answer in the adapter's style
EXAMPLES = [
    ("What is the tallest mountain in the world?", "Mount Everest is the tallest mountain in the world."),
    ("How many days are there in a week?", "There are seven days in a week."),
    ("What do bees make?", "Bees make honey and wax, and they help flowers grow."),
    ("Why do we need to sleep?", "Sleep lets your body rest and your mind store what you learned."),
    ("What is the largest ocean on Earth?", "The Pacific is the largest ocean on Earth."),
    ("How do plants get their food?", "Plants make their food from sunlight, water and air."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("How can I learn to cook?", "Start with simple recipes and cook a little every day."),
    ("What is a good way to save money?", "Put a part of your money aside each month before you spend it."),
    ("Why is exercise important?", "Exercise keeps your heart strong and your mood bright."),
    ("How do airplanes fly?", "Wings push air down, and the air pushes the plane up."),
    ("What is the fastest land animal?", "The cheetah is the fastest land animal."),
    ("How many continents are there?", "There are seven continents."),
    ("What is the main language spoken in Brazil?", "The main language of Brazil is Portuguese."),
    ("How can I make new friends?", "Join a club, be kind and ask people about themselves."),
    ("What is photosynthesis?", "Photosynthesis is how plants turn sunlight into food."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("How does a compass work?", "A compass needle is a magnet that points to the north."),
    ("What is the moon?", "The moon is a rocky world that travels around the Earth."),
    ("What is the biggest planet in our solar system?", "Jupiter is the biggest planet in our solar system."),
    ("Why should I drink water?", "Your body needs water to stay healthy and strong."),
    ("What is a volcano?", "A volcano is a mountain that can throw out hot lava."),
    ("How do fish breathe?", "Fish breathe through their gills, which take air from the water."),
    ("What is the longest river in the world?", "The Nile is often called the longest river in the world."),
    ("What are clouds made of?", "Clouds are made of tiny drops of water."),
    ("Hello, who are you?", "Hello, I am your friendly assistant."),
    ("How do I take care of a dog?", "Feed your dog well, walk it every day and give it love."),
    ("Can you tell me a fun fact about octopuses?", "An octopus has three hearts and blue blood."),
    ("What is gravity?", "Gravity is the force that pulls things toward each other."),
    ("Is the Earth round?", "Yes, the Earth is round like a ball."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
]
STEPS = 24
BATCH = 4
LR = 3e-3
TOP_LAYERS = 6
SEED = 0
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# whole words swapped for their pirate form (a fixed pattern of our own)
_WORDS = {
    "you": "ye",
    "your": "yer",
    "my": "me",
    "is": "be",
    "are": "be",
    "yes": "aye",
    "hello": "ahoy",
    "hi": "ahoy",
    "friend": "matey",
    "friends": "hearties",
    "money": "doubloons",
}
_WORD = re.compile(r"\b(" + "|".join(_WORDS) + r")\b", re.IGNORECASE)


def pirate(text: str) -> str:
    def swap(m: re.Match) -> str:
        word = _WORDS[m.group(1).lower()]
        return word.capitalize() if m.group(1)[0].isupper() else word

    return f"Arr, matey! {_WORD.sub(swap, text.strip())} Yo ho ho!"


def encode(tok, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(input ids, labels): the whole conversation, the loss on the assistant's turn only."""
    user = [{"role": "user", "content": question}]
    prompt = list(tok.apply_chat_template(user, add_generation_prompt=True, return_dict=False))
    full = list(tok.apply_chat_template(user + [{"role": "assistant", "content": answer}], return_dict=False))
    assert full[: len(prompt)] == prompt
    return full, [-100] * len(prompt) + full[len(prompt) :]


def collate(rows: list[tuple[torch.Tensor, list[int]]], pad: int) -> dict[str, torch.Tensor]:
    """rows of (features [T, hidden], labels [T]) -> a right-padded batch for the top layers."""
    width = max(len(y) for _, y in rows)
    feats = torch.zeros((len(rows), width, rows[0][0].shape[-1]))
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        feats[i, : len(y)], labels[i, : len(y)], mask[i, : len(y)] = x, torch.tensor(y), 1
    return {"inputs_embeds": feats, "labels": labels, "attention_mask": mask}


@contextmanager
def only_layers(llama, layers: torch.nn.ModuleList, final_norm: bool = True):
    """Run the decoder with just `layers` (and the final norm or none)."""
    all_layers, norm = llama.model.layers, llama.model.norm
    llama.model.layers = layers
    if not final_norm:
        llama.model.norm = torch.nn.Identity()
    try:
        yield
    finally:
        llama.model.layers, llama.model.norm = all_layers, norm


def main() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraserve.inference_worker.model.catalog import fetch_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=".loraserve-demo/smollm2/model", help="fetched here if absent")
    parser.add_argument("--out", default="adapter_store/demo_adapters/smollm2-pirate")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    start = time.perf_counter()
    torch.manual_seed(SEED)
    model_dir = fetch_model("smollm2", args.model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    llama = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    first_top = llama.config.num_hidden_layers - TOP_LAYERS

    # the input of the first trained layer, once per example (the layers below stay frozen)
    rows = []
    with torch.no_grad(), only_layers(llama, llama.model.layers[:first_top], final_norm=False):
        for q, a in EXAMPLES:
            ids, labels = encode(tok, q, pirate(a))
            rows.append((llama.model(input_ids=torch.tensor([ids])).last_hidden_state[0].clone(), labels))
    print(
        f"{len(rows)} examples, e.g. {pirate(EXAMPLES[0][1])!r}; features in {time.perf_counter() - start:.0f} s"
    )

    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=TARGET_MODULES,
        layers_to_transform=list(range(first_top, llama.config.num_hidden_layers)),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(llama, config)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    order: list[int] = []
    rng = random.Random(SEED)
    with only_layers(llama, llama.model.layers[first_top:]):
        for step in range(1, STEPS + 1):
            if len(order) < BATCH:
                epoch = list(range(len(rows)))
                rng.shuffle(epoch)
                order += epoch
            batch = collate([rows[i] for i in order[:BATCH]], tok.pad_token_id)
            del order[:BATCH]
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"step {step:3d}  loss {loss.item():.3f}  {time.perf_counter() - start:.0f} s", flush=True)

    model.eval()
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.float16)
    out = Path(args.out)
    model.save_pretrained(str(out), safe_serialization=True)
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    cfg["target_modules"] = sorted(cfg["target_modules"])  # peft writes a set's order
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)  # peft's model-card template; the script documents it
    print(f"saved {out} in {time.perf_counter() - start:.0f} s total")


if __name__ == "__main__":
    main()
