"""Operator-level parallelism on 8 devices, written as MindSpore's tutorial writes it: a
network of MatMul and ReLU primitives, each given a strategy with ``.shard()``, trained with
``Model`` on a dataset that gives each device its own slice of the batch.

    mpirun -n 8 python examples/operator_parallel.py

To run it under MindSpore, change the import line below to ``import mindspore as ms``.
"""

import json
import os

import numpy as np

import simpar.mindspore as ms  # under MindSpore: import mindspore as ms

STRATEGY_FILE = "./operator_parallel_strategy.json"
FEATURES, HIDDEN, CLASSES = 64, 128, 10
SAMPLES, BATCH_PER_DEVICE = 512, 4


class Network(ms.nn.Cell):
    """Three fully connected layers written with primitives: x W1, ReLU, x W2, ReLU, x W3."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(1)
        self.fc1_weight = ms.Parameter(ms.Tensor(0.1 * rng.standard_normal((FEATURES, HIDDEN)),
                                                 ms.float32), name="fc1_weight")
        self.fc2_weight = ms.Parameter(ms.Tensor(0.1 * rng.standard_normal((HIDDEN, HIDDEN)),
                                                 ms.float32), name="fc2_weight")
        self.fc3_weight = ms.Parameter(ms.Tensor(0.1 * rng.standard_normal((HIDDEN, CLASSES)),
                                                 ms.float32), name="fc3_weight")
        self.matmul1 = ms.ops.MatMul()
        self.relu1 = ms.ops.ReLU()
        self.matmul2 = ms.ops.MatMul()
        self.relu2 = ms.ops.ReLU()
        self.matmul3 = ms.ops.MatMul()

    def construct(self, x):
        x = self.relu1(self.matmul1(x, self.fc1_weight))
        x = self.relu2(self.matmul2(x, self.fc2_weight))
        return self.matmul3(x, self.fc3_weight)


def create_dataset(batch_size, num_shards=None, shard_id=None):
    """A classification set made up here (no download): labels from a fixed random
    projection of the features."""
    rng = np.random.default_rng(0)
    features = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    labels = np.argmax(features @ rng.standard_normal((FEATURES, CLASSES)), axis=1)
    dataset = ms.dataset.NumpySlicesDataset((features, labels.astype(np.int32)),
                                            column_names=["image", "label"], shuffle=True,
                                            num_shards=num_shards, shard_id=shard_id)
    return dataset.batch(batch_size, drop_remainder=True)


def shard_network(net):
    """The strategies of MindSpore's operator-parallel tutorial, on 8 devices."""
    net.matmul1.shard(((2, 4), (4, 1)))
    net.relu1.shard(((4, 1),))
    net.matmul2.shard(((1, 8), (8, 1)))
    net.relu2.shard(((8, 1),))
    return net


def main(epochs=2, callbacks=()):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.communication.init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL,
                                 strategy_ckpt_config={"save_file": STRATEGY_FILE})
    ms.set_seed(1)
    net = shard_network(Network())
    dataset = create_dataset(BATCH_PER_DEVICE, ms.communication.get_group_size(),
                             ms.communication.get_rank())
    loss_fn = ms.nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    optimizer = ms.nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    model = ms.train.Model(net, loss_fn=loss_fn, optimizer=optimizer)
    model.train(epochs, dataset,
                callbacks=[ms.train.LossMonitor(per_print_times=16), *callbacks])
    if ms.communication.get_rank() == 0:
        with open(STRATEGY_FILE) as f:
            items = json.load(f)["parallel_strategy_item"]
        for name, item in items.items():
            print(f"{name.rsplit('/', 1)[-1]}: {item['parallel_strategy']}")
        os.remove(STRATEGY_FILE)
    return model


if __name__ == "__main__":
    main()
