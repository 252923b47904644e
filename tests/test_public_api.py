import servekit


def test_all_is_sorted_and_names_exactly_the_public_exports():
    assert servekit.__all__ == sorted(servekit.__all__)
    public = {n for n in dir(servekit) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(servekit, n)).__name__ == "module"}
    assert set(servekit.__all__) == public - modules
