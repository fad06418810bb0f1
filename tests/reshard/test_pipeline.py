import threading

from reshard.pipeline import ordered_map

SIZES = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def test_results_come_in_order_and_oversize_items_run_in_the_caller():
    in_caller = {}

    def work(size: int) -> int:
        in_caller[size] = threading.current_thread() is threading.main_thread()
        return size

    assert list(ordered_map(work, SIZES, workers=2, budget=8, cost=lambda s: s)) == SIZES
    assert in_caller[9] is True  # larger than the budget alone
    assert in_caller[4] is False


def test_submitted_but_unconsumed_items_stay_within_the_budget():
    submitted, consumed, seen = [], [], []

    def items():
        for size in SIZES:
            seen.append(sum(submitted) - sum(consumed))  # outstanding when the next item is asked for
            submitted.append(size)
            yield size

    for size in ordered_map(lambda s: s, items(), workers=2, budget=8, cost=lambda s: s):
        consumed.append(size)
    assert consumed == SIZES
    assert max(seen) <= 8 and max(seen) > 0
