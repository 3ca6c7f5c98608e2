import overtake.mdp as mdp


def test_all_is_sorted_and_complete():
    assert mdp.__all__ == sorted(mdp.__all__)
    for name in mdp.__all__:
        assert hasattr(mdp, name), name
