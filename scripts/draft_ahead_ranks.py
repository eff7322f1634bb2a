"""Where the actual verdict of each block ranks among the drafter's ranked verdicts (drafting ahead's hit rate if the
drafter prepared the top N), through the services (LocalCluster), 4 prompts x 48 tokens, T = 1 and greedy, the default
tree and k = 4. Usage: PYTHONPATH=. python scripts/draft_ahead_ranks.py smollm2-sd2"""
import asyncio, sys, time
from collections import Counter
import drafter_service.ahead as A
from coordinator.local import LocalCluster
from steerspec.serving.linkemu import LinkModel
from steerspec.models.checkpoints import resolve_model_dir
from transformers import AutoTokenizer
ranks = Counter()
orig_prepare, orig_take = A.Ahead.prepare, A.Ahead.take
async def prepare(self, session, work):
    if not await self.idle(work):
        return
    work.ranked = session.kind.outcomes(self.drafter, session, 64)
def take(self, session, accepted, next_token, path):
    work = self.work.get(session.session_id)
    if work is not None and hasattr(work, "ranked"):
        want = (int(accepted), int(next_token), tuple(int(x) for x in path))
        r = next((i for i, o in enumerate(work.ranked) if (o.accepted, o.next_token, o.path) == want), 99)
        ranks[r] += 1
    return orig_take(self, session, accepted, next_token, path)
A.Ahead.prepare, A.Ahead.take = prepare, take
V, D = str(resolve_model_dir("smollm2")), str(resolve_model_dir(sys.argv[1]))
tok = AutoTokenizer.from_pretrained(V)
texts = ["def fibonacci(n):", "class Queue:\n    def __init__(self):", "import os\nimport sys\n\ndef main():", "def binary_search(items, target):"]
async def main():
    async with LocalCluster(V, D, tokenizer=V) as c:
        for T in (1.0, 0.0):
            for shape in ({"tree": "default"}, {"k": 4}):
                ranks.clear()
                for i, t in enumerate(texts):
                    p = tok(t, add_special_tokens=False)["input_ids"]
                    await c.generate(p, max_new_tokens=48, temperature=T, seed=i, steering=c.steering, draft_ahead="on", **shape)
                n = sum(ranks.values())
                cum = [sum(v for r, v in ranks.items() if r < k) / n for k in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)]
                print(T, shape, n, "hit@1,2,3,4,6,8,12,16,32,64:", [round(x, 2) for x in cum], flush=True)
asyncio.run(main())
