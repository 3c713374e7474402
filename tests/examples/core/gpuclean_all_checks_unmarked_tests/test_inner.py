


def test_unmarked():
    pass
