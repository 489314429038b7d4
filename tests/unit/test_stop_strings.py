from omlx.engine.stop_strings import StopStringMatcher


def test_stop_string_split_across_segments_is_never_sent():
    m = StopStringMatcher(["STOP"])
    sent = []
    for seg in ["hello S", "T", "OP world"]:
        text, hit = m.feed(seg)
        sent.append(text)
        if hit:
            break
    assert "".join(sent) == "hello " and hit


def test_partial_prefix_released_when_it_does_not_complete():
    m = StopStringMatcher(["</end>"])
    assert m.feed("a </e") == ("a ", False)
    assert m.feed("xt") == ("</ext", False)
    assert m.feed("tail</", final=True) == ("tail</", False)


def test_earliest_of_several_stops_wins():
    m = StopStringMatcher(["bb", "a"])
    assert m.feed("xxbbya") == ("xx", True)
