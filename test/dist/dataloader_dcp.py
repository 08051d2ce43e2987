"""Run under torchrun: save the dataloader with real DCP, load it into a never-iterated loader.

    torchrun --nproc_per_node=2 test/dist/dataloader_dcp.py CORPUS CKPT_DIR NUM_WORKERS

Exits 0 when the loaded loader yields exactly the batches the original yielded next.
"""

import sys
import warnings

warnings.filterwarnings("ignore", message=".*set_vital.*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from torchtitan.data import ParallelDataLoader, TokenDataset  # noqa: E402
from torchtitan.data.sources import resolve_source  # noqa: E402
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer  # noqa: E402


def loader(corpus: str, workers: int) -> ParallelDataLoader:
    ds = TokenDataset(
        [resolve_source(path=corpus)], Tokenizer(DEFAULT_TOKENIZER_PATH), 32,
        dp_rank=dist.get_rank(), dp_world=dist.get_world_size(), data_shards=4, seed=3,
    )  # fmt: skip
    return ParallelDataLoader(ds, 2, num_workers=workers, snapshot_every_n_steps=3)


def main():
    corpus, ckpt, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    first = loader(corpus, workers)
    for _ in range(3):
        next(first)
    dcp.save({"dataloader": first.state_dict()}, checkpoint_id=ckpt)
    reference = [next(first) for _ in range(5)]

    fresh = loader(corpus, workers)  # never iterated: it has no state for DCP to fill in place
    keys = [k for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata if k.startswith("dataloader.")]
    assert len(keys) == dist.get_world_size(), keys  # one entry per rank survived DCP
    state = {"dataloader": {k.split(".", 1)[1]: b"" for k in keys}}
    dcp.load(state, checkpoint_id=ckpt)
    fresh.load_state_dict(state["dataloader"])
    for a, b in zip((next(fresh) for _ in range(5)), reference):
        assert torch.equal(a["input"], b["input"]) and torch.equal(a["label"], b["label"])
        assert a["spans"] == b["spans"]
    print(f"rank {dist.get_rank()}: dataloader restored exactly", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
