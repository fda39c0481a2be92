"""S17's input-grounded prompts: a passage in the prompt that the answer repeats.

Rewriting, summarising or editing a given text, and answering from a retrieved passage, all
produce answers whose words come mostly from the prompt: the workload where n-gram prompt
lookup proposes runs the model accepts. Each prompt asks for the passage back (copied, or
rewritten lightly) and holds a passage of `SENTENCES_PER_PASSAGE` plain sentences drawn, seeded,
from a fixed bank, so every server at a level gets the same prompts and each level new ones.
"""

from __future__ import annotations

import random

SENTENCES_PER_PASSAGE = 10  # ~200 tokens with SmolLM2's tokenizer
INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word.",
    "Copy out the passage below without changing anything.",
    "Rewrite the following notes as they are, keeping every sentence in order.",
    "Proofread the passage below and write it out again in full.",
)
SENTENCES = (
    "The city council met on Tuesday to discuss the new budget for the coming year.",
    "The mayor said that the library would stay open on weekends through the winter.",
    "Two new buses will serve the northern district from the first of March.",
    "The park near the river will be cleaned before the summer festival begins.",
    "Several residents asked about the cost of the new buses and the drivers' wages.",
    "The treasurer answered that the money came from a state grant, not from local taxes.",
    "A small bakery on Main Street won a regional prize for its rye bread.",
    "The school board approved a plan to repair the roof of the old gymnasium.",
    "Heavy rain closed the bridge on Elm Road for most of Wednesday afternoon.",
    "Volunteers planted forty oak trees along the path behind the hospital.",
    "The museum will open an exhibition of maps drawn by early sailors.",
    "Students from the high school built a weather station on the roof.",
    "The fire department held an open day with ladders, hoses and a rescue drill.",
    "A new crossing with traffic lights was installed outside the primary school.",
    "The farmers' market will move to the town square on Saturday mornings.",
    "Local musicians played in the bandstand every evening during the fair.",
    "The railway company promised faster trains to the capital by next autumn.",
    "A lost dog was found asleep in the post office and returned to its owner.",
    "The swimming pool will close for two weeks while its pumps are replaced.",
    "The council thanked the volunteers who cleared snow from the footpaths.",
    "Engineers inspected the dam after the spring floods and found no damage.",
    "The hospital added a second ambulance to shorten waiting times at night.",
    "A book club meets in the library on the last Thursday of every month.",
    "The town's oldest resident celebrated her hundred and third birthday.",
    "New bicycle racks were placed outside the station and the town hall.",
    "The theatre group will perform a comedy about a clock that runs backwards.",
    "A storm knocked down power lines, and repairs took most of the night.",
    "The chess club won the county championship for the second year running.",
    "Workers began laying new water pipes under the streets of the old town.",
    "The zoo welcomed a pair of red pandas from a sanctuary in the mountains.",
    "Shops on the harbour front agreed to close at nine during the summer.",
    "The police reminded drivers to slow down near the market on busy days.",
)


def grounded_prompts(num: int, seed: int) -> list[str]:
    """`num` prompts, each an instruction and a passage, the same for the same `seed`."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        passage = " ".join(rng.sample(SENTENCES, SENTENCES_PER_PASSAGE))
        prompts.append(f"{rng.choice(INSTRUCTIONS)}\n\n{passage}")
    return prompts


def guidellm_data(num: int, seed: int, output_tokens: int) -> dict:
    """guidellm 0.8.1's in-memory data of `grounded_prompts` (exactly `output_tokens` out:
    guidellm then asks for them with `ignore_eos`)."""
    rows = [{"prompt": p, "output_tokens_count": output_tokens}
            for p in grounded_prompts(num, seed)]  # fmt: skip
    return {"kind": "in_memory_dict_list", "data": rows}
