"""Which context does an answer come from? Leave each one out of the composed state and see
how much the answer's loss rises (leave-one-out attribution over composed states). This is the
method spelled out on states in memory; for a store, `store.attribute(prompt, answer, k=5)` does
it over the retrieved contexts (as `picaso query --answer` and `POST /v1/attribute`).

    python examples/python/attribution.py
"""
import picaso

model = picaso.Model.load()
contexts = ["Marie Curie was born in Warsaw.\n\n", "Honey never spoils.\n\n", "Curie won two Nobel Prizes.\n\n"]
states = [model.state(c) for c in contexts]
ids = model.encode("Marie Curie was born in Warsaw")
n = len(model.encode(" Warsaw"))
loss = lambda parts: -model.score(ids, state=picaso.compose(parts, "picaso-r"))[-n:].mean()
full = loss(states)
for i, c in enumerate(contexts):
    print(f"{loss(states[:i] + states[i + 1:]) - full:+.3f} nats without {c.strip()!r}")
