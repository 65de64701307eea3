from evenflow.proto.hashing import ROOT_PARENT, block_hash, chain_hashes, namespace_salt


def test_chain_covers_full_blocks_only_and_chains_parents():
    tokens = list(range(37))
    hashes = chain_hashes(tokens, 16)
    assert len(hashes) == 2  # the 5-token tail is not a full block
    assert hashes[0] == block_hash(ROOT_PARENT, tokens[:16])
    assert hashes[1] == block_hash(hashes[0], tokens[16:32])


def test_same_block_under_another_prefix_or_model_differs():
    a = chain_hashes([1] * 16 + [2] * 16, 16)
    b = chain_hashes([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same tokens, different parent
    salted = chain_hashes([1] * 16, 16, namespace_salt("other-model"))
    assert salted[0] != a[0]
    assert chain_hashes([1] * 16 + [2] * 16, 16) == a  # deterministic
    assert all(0 <= h < 2**64 for h in a)
