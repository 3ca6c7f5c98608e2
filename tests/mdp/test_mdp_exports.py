import overtake.mdp as mdp


def test_all_is_sorted_and_complete():
    assert mdp.__all__ == sorted(mdp.__all__)
    for name in mdp.__all__:
        assert hasattr(mdp, name), name


def test_no_exported_name_is_a_module_name():
    """Importing a submodule sets a package attribute of its name: no function may share it."""
    import pkgutil
    import types

    modules = {m.name for m in pkgutil.iter_modules(mdp.__path__)}
    assert not modules & set(mdp.__all__)
    assert type(mdp) is types.ModuleType  # a plain module: no class that guards its attributes
    import overtake.mdp.comparison
    import overtake.mdp.simulation
    import overtake.mdp.solver  # noqa: F401

    assert mdp.solve is overtake.mdp.solver.solve and mdp.compare is overtake.mdp.comparison.compare
    assert mdp.simulate is overtake.mdp.simulation.simulate
