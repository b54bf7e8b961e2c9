"""Power cuts with the journal (issue 8 point 3): the daemon generates on the arm64 guest with
its state directory on a disk that really loses unflushed writes (nbdkit's writeback cache),
power is cut at a random moment, the guest boots again and the daemon warm-starts.

Checked after every cut: `PRAGMA integrity_check` is ok; every request acknowledged before the
cut is in the journal and completes after the reboot; no token journaled before the cut changed.
The control run (flushes discarded) must lose acknowledged requests, which proves the harness
can fail. The model is the tiny llama with the default tokenizer (tests/qemu/tiny_model.py):
the cut tests the journal, not TCG arithmetic. bench/qemu_powercut.py --journal runs 20+ cuts.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from qemu.build_arm64_guest import GuestImage
from qemu.journal_cut import MAX_TOKENS, run_journal_cut
from qemu.skips import arm64_image_or_skip
from qemu.tiny_model import write_tiny_llama

pytestmark = [pytest.mark.qemu, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def arm64() -> GuestImage:
    return arm64_image_or_skip("journal power-cut tests", ("nbdkit", "nbdkit"))

# CI cuts three times and runs the control once (bench/qemu_powercut.py runs 20+). The moment of
# the cut is random; the seed is printed with every result and EDGE_AGENT_QEMU_CUT_SEED
# replays a run's delays.
CUTS = int(os.environ.get("EDGE_AGENT_QEMU_CUTS", "3"))
SEED = int(os.environ.get("EDGE_AGENT_QEMU_CUT_SEED") or random.SystemRandom().randrange(10**6))




@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.mark.parametrize("index", range(CUTS))
def test_cut_during_generation_loses_nothing_acknowledged(arm64: GuestImage, tiny: Path,
                                                          index: int) -> None:
    delay = round(random.Random(SEED + index).uniform(0.5, 3.0), 2)
    cut = run_journal_cut(arm64, tiny, "writeback", delay)
    f = cut.facts
    print(f"\njournal cut writeback (EDGE_AGENT_QEMU_CUT_SEED={SEED}, cut {index}) delay {delay}"
          f" s: acked {len(cut.acked)}, journaled tokens {cut.journaled_tokens}, boot1 "
          f"{f['boot1_s']} s, boot2 {f['boot2_s']} s")
    assert len(cut.acked) >= 2, cut.facts["output_tail"]  # the workload meant something
    assert cut.integrity_ok, cut.before.get("integrity")
    assert cut.lost_acked == [], cut.lost_acked
    assert cut.unfinished == [], (cut.unfinished_states, f["output_tail"])
    assert cut.changed == [], cut.changed
    final = cut.after["requests"]
    # Completed means all its tokens (no eos in a random tiny model's 40 samples is not
    # guaranteed, so the count is at most MAX_TOKENS and the state is done).
    assert all(0 < len(final[r]["tokens"]) <= MAX_TOKENS for r in cut.acked), final
    # The cut really fell during generation: some acknowledged request was not finished.
    assert any(cut.before["requests"][r]["state"] != "done" for r in cut.acked), cut.before


def test_control_run_with_flushes_discarded_loses_acknowledged_requests(
        arm64: GuestImage, tiny: Path) -> None:
    cut = run_journal_cut(arm64, tiny, "discard-flush", 2.0)
    print(f"\njournal cut control: acked {len(cut.acked)}, lost {len(cut.lost_acked)}")
    assert len(cut.acked) >= 2
    assert cut.lost_acked, "the control kept every acknowledged request: the harness cannot fail"
