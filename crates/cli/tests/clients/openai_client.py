"""Drives a running `picaso serve` with the official `openai` client, as an application would:
list the models, complete (plain and streamed) with picaso's fields in `extra_body`, and read
errors as the client's exceptions. Prints one JSON object for the Rust test to check.

    python openai_client.py http://127.0.0.1:PORT
"""
import json
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
models = [m.id for m in client.models.list()]
ask = dict(model=models[0], prompt="The tower", max_tokens=6, temperature=0, extra_body={"contexts": [3, 2]})
plain = client.completions.create(**ask)
chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
usage = [c.usage.completion_tokens for c in chunks if c.usage]
errors = {}
for name, bad, kind in [
    ("model", dict(ask, model="gpt-3.5-turbo-instruct"), openai.NotFoundError),
    ("context", dict(ask, extra_body={"contexts": [999]}), openai.NotFoundError),
    ("n", dict(ask, n=2), openai.BadRequestError),
]:
    try:
        client.completions.create(**bad)
        errors[name] = None
    except kind as e:
        errors[name] = {"status": e.status_code, "message": e.body.get("message") if isinstance(e.body, dict) else str(e)}
# Log-probabilities of the prompt (echo) and of 3 generated tokens, 5 alternatives each.
scored = client.completions.create(model=models[0], prompt="The tower is tall", max_tokens=3, temperature=0,
                                   logprobs=5, echo=True)
lp = scored.choices[0].logprobs
# Several prompts: one choice each, in order.
batch = client.completions.create(model=models[0], prompt=["The tower", "Cats are"], max_tokens=4, temperature=0)
# Chat, with a template in the request (the test model ships none), plain and streamed.
template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
chat_ask = dict(model=models[0], messages=[{"role": "user", "content": "The tower"}], max_tokens=6, temperature=0)
chat = client.chat.completions.create(**chat_ask, extra_body={"chat_template": template})
chat_lp = client.chat.completions.create(**chat_ask, extra_body={"chat_template": template}, logprobs=True,
                                        top_logprobs=3).choices[0].logprobs.content
chat_chunks = list(client.chat.completions.create(**chat_ask, extra_body={"chat_template": template}, stream=True))
try:
    client.chat.completions.create(**chat_ask)
    errors["no_template"] = None
except openai.BadRequestError as e:
    errors["no_template"] = {"status": e.status_code, "message": e.body.get("message") if isinstance(e.body, dict) else str(e)}
print(json.dumps({
    "echo": {"text": scored.choices[0].text, "tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
             "top_logprobs": lp.top_logprobs, "text_offset": lp.text_offset},
    "batch": [(c.index, c.text) for c in batch.choices],
    "chat": {"content": chat.choices[0].message.content, "role": chat.choices[0].message.role,
             "object": chat.object, "finish_reason": chat.choices[0].finish_reason,
             "logprobs": [[t.token, t.logprob, [a.token for a in t.top_logprobs]] for t in chat_lp],
             "streamed": "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)},
    "version": openai.__version__,
    "models": models,
    "text": plain.choices[0].text,
    "finish_reason": plain.choices[0].finish_reason,
    "completion_tokens": plain.usage.completion_tokens,
    "streamed": "".join(c.choices[0].text for c in chunks if c.choices),
    "streamed_tokens": usage[-1] if usage else None,
    "errors": errors,
}))
