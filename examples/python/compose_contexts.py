"""Compose the states of three contexts and continue a prompt from them, against reading them.

    python examples/python/compose_contexts.py [MODEL_DIR]
"""
import sys
import time

import picaso

model = picaso.Model.load(sys.argv[1] if len(sys.argv) > 1 else None)  # default: the bundled model
contexts = [
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris.\n\n",
    "It was designed by the company of the engineer Gustave Eiffel.\n\n",
    "The tower was finished in 1889 as the entrance arch of the World's Fair.\n\n",
]
states = [model.state(c) for c in contexts]  # once per context: this is what a store keeps
question, answer = "The tower was designed by the company of", " Gustave Eiffel"

t = time.perf_counter()
composed = picaso.compose(states, method="picaso-r")
compose_ms = 1e3 * (time.perf_counter() - t)
t = time.perf_counter()
read = model.state("".join(contexts))
read_ms = 1e3 * (time.perf_counter() - t)

ids = model.encode(question + answer)
n_answer = len(model.encode(answer))
for name, state in [("no context", None), ("read the text", read), ("picaso-r", composed)]:
    loss = -model.score(ids, state=state)[-n_answer:].mean()
    text = model.generate(question, state=state, max_tokens=8).text
    print(f"{name:>13}: answer loss {loss:.3f} nats/token · {question}{text!r}")
print(f"state ready in {compose_ms:.2f} ms composed, {read_ms:.1f} ms by reading the contexts")
