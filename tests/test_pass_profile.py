"""What a sharing member learns of its passes (waterwave/pipeline/pass_profile.py):
regions read at points, gates cut by the level's movement, predictions per
size bucket from the latest passes, scaled past every size seen, and the
first passes a session keeps for later trials of one model."""
from hypothesis import given, settings
from hypothesis import strategies as st

from waterwave.pipeline.pass_profile import (RECENT, REST_SLACK, START, FirstPasses, PassRecorder,
                                             Profiles, Region, coarsen, gate_keys, rise_of,
                                             split_for, with_slack)


def test_a_recorder_turns_readings_into_regions():
    r = PassRecorder(1000)
    r.at(("a", 0), 1500, 1800)   # rose to 1800, ended at 1500
    r.at(("b", 0), 1200, 1500)   # fell
    assert r.regions == [Region(START, 800, 500), Region(("a", 0), 0, -300)]
    assert rise_of(r.regions) == 800


def test_gates_follow_the_level_not_the_traffic():
    # Temporaries that come and go within a region move no level: no gate.
    churn = [Region(START, 0, 0)] + [Region(("t", i), 1000, 0) for i in range(50)]
    assert gate_keys(churn, 500) == set()
    # A forward rising and a backward falling: gates every ``split`` each way.
    up = [Region(START, 10, 10)] + [Region(("f", i), 10, 10) for i in range(1, 16)]
    down = [Region(("b", i), 0, -10) for i in range(16)]
    gates = gate_keys(up + down, 40)
    assert {k for k in gates if k[0] == "f"} == {("f", 4), ("f", 8), ("f", 12)}
    assert len({k for k in gates if k[0] == "b"}) == 4
    # A small pass under a large budget: no gate inside.
    assert split_for(up + down, 1 << 30) == (1 << 30) // 256
    assert gate_keys(up + down, split_for(up + down, 1 << 30)) == set()


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(-800, 800)), min_size=1, max_size=40),
       st.integers(1, 3000))
def test_coarse_regions_keep_the_pass_whole(values, split):
    regions = [Region(START if i == 0 else ("p", i), rise, net)
               for i, (rise, net) in enumerate(values)]
    coarse = coarsen(regions, gate_keys(regions, split))
    assert rise_of(coarse) == rise_of(regions)
    assert sum(r.net for r in coarse) == sum(r.net for r in regions)
    assert coarse[0].key == START


def one_region(rise, net):
    return [Region(START, rise, net)]


def test_predictions_come_from_the_latest_passes_per_size():
    p = Profiles()
    sig = (True, True)
    assert p.predict(sig, 100) is None  # nothing known: measure it alone
    p.learn(sig, 100, one_region(5000, 3000))  # a first pass that made optimizer state
    for _ in range(2 * RECENT):
        p.learn(sig, 100, one_region(2000, 0))
    rise, rest, net = p.predict(sig, 100).at(START)
    assert (rise, rest, net) == (2000, 2000, 0)  # the first pass forgotten
    # A smaller batch: bounded by the size above it.
    assert p.predict(sig, 60).at(START)[0] == 2000
    # Past every size seen: scaled by the square of the ratio.
    assert p.predict(sig, 200).at(START)[0] == 8000
    p.learn(sig, 200, one_region(4100, 0))
    assert p.predict(sig, 200).at(START)[0] == 4100
    assert p.predict(sig, 150).at(START)[0] == 4100  # the bucket at or above it
    assert p.predict((False, False), 100) is None   # another kind of pass


def test_a_prediction_at_a_gate_sums_what_is_left_of_the_pass():
    p = Profiles()
    regions = [Region(START, 100, 100), Region(("g", 1), 300, 200), Region(("g", 2), 50, -250)]
    p.learn((True, True), 10, regions)
    prediction = p.predict((True, True), 10)
    assert prediction.at(START) == (100, 100 + 300, 50)
    assert prediction.at(("g", 1)) == (300, 300, -50)
    assert prediction.at(("g", 2)) == (50, 50, -250)
    # A point the latest pass did not reach: bounded by the whole pass.
    assert prediction.at(("other", 0)) == (400, 400, 50)


def test_the_rest_of_a_pass_is_asked_with_a_little_slack():
    assert with_slack(0) == 0 and with_slack(-5) == -5
    assert with_slack(1600) == 1600 + int(1600 * REST_SLACK) > 1600


def test_first_passes_keep_the_first_of_each_kind_and_the_latest_kinds():
    """A session's first passes (``FirstPasses``): the first measured of a
    kind stays (a later one of the kind, whose one-time costs were paid,
    does not replace it); past ``MOST`` kinds the oldest goes."""
    seen = FirstPasses()
    seen.note(("mlp", (True, True), 64), 1000, 400, 300)
    seen.note(("mlp", (True, True), 64), 600, 100)
    assert seen.get(("mlp", (True, True), 64)) == (1000, 400, 300, 0)
    assert seen.get(("mlp", (True, True), 128)) is None
    for k in range(FirstPasses.MOST):
        seen.note(("other", k), k, 0)
    assert seen.get(("mlp", (True, True), 64)) is None  # the oldest, dropped
    assert seen.get(("other", 0)) == (0, 0, 0, 0)  # held: the net where not told
    assert seen.get(("other", FirstPasses.MOST - 1)).rise == FirstPasses.MOST - 1


def test_a_kind_none_measured_is_guessed_from_the_kinds_measured_never_short_of_either():
    """``FirstPasses.room_to_go_on_guess``: for a model of ``base`` bytes
    whose kind none measured, the most any measured first pass rose and
    left held, or that scaled by the models' bytes, whichever is more; 0
    where none was measured."""
    seen = FirstPasses()
    assert seen.room_to_go_on_guess(100) == 0
    seen.note(("small", (True, True), 64), 60, 50, 40, base=20)   # 100 to go on, 5x its model
    seen.note(("large", (True, True), 64), 100, 80, 50, base=100)  # 150, 1.5x
    seen.note(("no model", (True, True), 64), 10, 0, 0)            # no bytes: not scaled
    assert seen.room_to_go_on_guess(10) == 150    # smaller than both: the most seen
    assert seen.room_to_go_on_guess(400) == 2000  # larger: 5x its bytes
