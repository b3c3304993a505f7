import os, sys, tempfile
import torch, torch.distributed as dist
import torch.multiprocessing as mp
sys.path.insert(0, "/work/main/tests")

BASE = ["--train.global_batch_size", "8", "--train.micro_batch_size", "4", "--train.seq_len", "64",
        "--train.precision", "fp32", "--logging.wandb.mode", "disabled", "--train.eval_interval", "0",
        "--train.sample_tokens", "0", "--model.n_layers", "2", "--model.d_model", "64", "--model.n_heads", "4",
        "--optim.lr", "3e-3", "--optim.warmup_steps", "2"]
MODERN = ["--model.name", "gpt-modern-1b", "--model.n_kv_heads", "2", "--model.ffn_hidden_size", "128",]

def worker(rank, world, init, cases, out):
    from dataclasses import replace
    from hybridpar.config.cli import load_config
    from hybridpar.parallel.distributed import WorldInfo, init_mesh
    from hybridpar.resolve import resolve
    from hybridpar.trainer import Trainer
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    res = {}
    try:
        for name, argv in cases:
            cfg = load_config([*BASE, "--data.cache_dir", "/tmp/curves_cache", *argv])
            run = resolve(cfg, WorldInfo(rank, world, rank, world), torch.device("cpu"))
            trainer = Trainer(run, init_mesh(run.layout.degrees, run.device))
            losses = []
            for step in range(8):
                loss, gn, lr = trainer.train_step(step)
                losses.append(float(trainer.dp_sum(loss.detach().clone())))
            trainer.data.close()
            res[name] = losses
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(res, out)

def run(world, cases):
    d = tempfile.mkdtemp()
    mp.spawn(worker, args=(world, f"{d}/init", cases, f"{d}/out.pt"), nprocs=world)
    return torch.load(f"{d}/out.pt")

if __name__ == "__main__":
    fam = MODERN if sys.argv[1] == "modern" else []
    ref = run(1, [("ref", fam)])["ref"]
    cp2 = run(2, [("cp2", [*fam, "--parallel.cp", "2", "--parallel.dp_shard", "1"])])["cp2"]
    four = run(4, [("cp4", [*fam, "--parallel.cp", "4", "--parallel.dp_shard", "1"]),
                   ("cp2tp2", [*fam, "--parallel.cp", "2", "--parallel.tp", "2", "--parallel.dp_shard", "1"]),
                   ("cp2dp2", [*fam, "--parallel.cp", "2", "--parallel.dp_shard", "2"])])
    print("ref", ref)
    for k, v in [("cp2", cp2), *four.items()]:
        print(k, max(abs(a / b - 1) for a, b in zip(v, ref)), v[-1])
