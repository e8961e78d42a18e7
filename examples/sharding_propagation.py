"""Sharding propagation on 8 devices, written as MindSpore's tutorial writes it: a
feed-forward network in which one operator is given a strategy, and ``auto_parallel`` with
``search_mode="sharding_propagation"`` gives every other operator the strategy that moves the
least data from it.

    mpirun -n 8 python examples/sharding_propagation.py

To run it under MindSpore, change the import line below to ``import mindspore as ms``.
"""

import json
import os

import numpy as np

import simpar.mindspore as ms  # under MindSpore: import mindspore as ms

STRATEGY_FILE = "./sharding_propagation_strategy.json"
WIDTH, CLASSES = 64, 8
SAMPLES, BATCH_PER_DEVICE = 256, 4


class Dense(ms.nn.Cell):
    """x W + b with primitives, so that each can be given a strategy."""

    def __init__(self, in_channels, out_channels, seed):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.weight = ms.Parameter(ms.Tensor(
            rng.standard_normal((in_channels, out_channels)) / np.sqrt(in_channels),
            ms.float32), name="weight")
        self.bias = ms.Parameter(ms.Tensor(np.zeros(out_channels), ms.float32), name="bias")
        self.matmul = ms.ops.MatMul()
        self.add = ms.ops.Add()

    def construct(self, x):
        return self.add(self.matmul(x, self.weight), self.bias)


class FFN(ms.nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1 = Dense(WIDTH, WIDTH, seed=1)
        self.relu = ms.ops.ReLU()
        self.dense2 = Dense(WIDTH, CLASSES, seed=2)

    def construct(self, x):
        return self.dense2(self.relu(self.dense1(x)))


def create_dataset(batch_size, num_shards=None, shard_id=None):
    rng = np.random.default_rng(0)
    features = rng.standard_normal((SAMPLES, WIDTH)).astype(np.float32)
    labels = np.argmax(features[:, :CLASSES], axis=1).astype(np.int32)
    dataset = ms.dataset.NumpySlicesDataset({"data": features, "label": labels}, shuffle=True,
                                            num_shards=num_shards, shard_id=shard_id)
    return dataset.batch(batch_size, drop_remainder=True)


def main(epochs=1, callbacks=()):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.communication.init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.AUTO_PARALLEL,
                                 search_mode="sharding_propagation",
                                 strategy_ckpt_config={"save_file": STRATEGY_FILE})
    ms.set_seed(1)
    net = FFN()
    net.dense1.matmul.shard(((2, 1), (1, 4)))   # the one strategy given; the rest propagate
    dataset = create_dataset(BATCH_PER_DEVICE, ms.communication.get_group_size(),
                             ms.communication.get_rank())
    loss_fn = ms.nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    optimizer = ms.nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    model = ms.train.Model(net, loss_fn=loss_fn, optimizer=optimizer)
    model.train(epochs, dataset,
                callbacks=[ms.train.LossMonitor(per_print_times=8), *callbacks])
    if ms.communication.get_rank() == 0:
        with open(STRATEGY_FILE) as f:
            items = json.load(f)["parallel_strategy_item"]
        for name, item in items.items():
            print(f"{name.rsplit('/', 1)[-1]}: {item['parallel_strategy']}")
        os.remove(STRATEGY_FILE)
    return model


if __name__ == "__main__":
    main()
