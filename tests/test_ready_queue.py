"""ReadyQueue pops in exactly libstdc++ std::priority_queue's order, ties included."""

import random
import shutil
import subprocess

import pytest

from gradfx.capture.trace.ready_queue import ReadyQueue

CPP = r"""
#include <cstdio>
#include <queue>
#include <vector>
struct Item { unsigned long long seq; int id; };
struct Cmp { bool operator()(const Item& a, const Item& b) const { return a.seq < b.seq; } };
int main() {
  std::priority_queue<Item, std::vector<Item>, Cmp> q;
  char op; unsigned long long seq; int id;
  while (scanf(" %c", &op) == 1) {
    if (op == 'u') { scanf("%llu %d", &seq, &id); q.push({seq, id}); }
    else { printf("%d\n", q.top().id); q.pop(); }
  }
}
"""


def _script(seed):
    rng = random.Random(seed)
    ops, size, next_id = [], 0, 0
    for _ in range(400):
        if size and rng.random() < 0.45:
            ops.append(("o",))
            size -= 1
        else:
            seq = rng.choice([2**64 - 1, rng.randrange(0, 6), rng.randrange(0, 1000)])
            ops.append(("u", seq, next_id))
            next_id += 1
            size += 1
    ops += [("o",)] * size
    return ops


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the reference")
def test_matches_std_priority_queue(tmp_path):
    src, exe = tmp_path / "pq.cpp", tmp_path / "pq"
    src.write_text(CPP)
    subprocess.run(["g++", "-O1", "-o", str(exe), str(src)], check=True)
    for seed in range(20):
        ops = _script(seed)
        text = "\n".join(" ".join(map(str, op)) for op in ops)
        expected = [int(x) for x in subprocess.run([str(exe)], input=text, capture_output=True,
                                                   text=True, check=True).stdout.split()]
        q, got = ReadyQueue(), []
        for op in ops:
            if op[0] == "u":
                q.push(op[1], op[2])
            else:
                got.append(q.pop())
        assert got == expected, f"seed {seed}"
