def test_plain():
    pass

def test_other():
    pass
