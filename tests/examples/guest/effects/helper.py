# A user's helper module whose asserts pytest rewrites (conftest.py registers it).
def check(value):
    assert value == 1
