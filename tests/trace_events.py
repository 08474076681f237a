"""Checks on Chrome trace-event documents (the profiler's trace), shared by the tests that read one.

Test modules import this from tests/ (on `sys.path` under pytest)."""

EPS_US = 1e-3  # microseconds: the float conversion of nanoseconds


def nested(events) -> bool:
    """Whether complete events (`ph: 'X'`) on one track nest, as trace viewers stack them: any two are
    disjoint or one holds the other."""
    stack = []
    for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        end = event["ts"] + event["dur"]
        while stack and stack[-1] <= event["ts"] + EPS_US:
            stack.pop()
        if stack and end > stack[-1] + EPS_US:
            return False
        stack.append(end)
    return True
