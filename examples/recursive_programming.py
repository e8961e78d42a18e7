"""Recursive programming on 8 devices, written as MindSpore's tutorial writes it: no
strategy is given; ``auto_parallel`` with ``search_mode="recursive_programming"`` cuts every
operator from the shapes alone (MindSpore's symbolic cost model), and ``Model`` trains the
result on a dataset that gives each device its own slice of the batch.

    mpirun -n 8 python examples/recursive_programming.py

To run it under MindSpore, change the import line below to ``import mindspore as ms``.
"""

import json
import os

import numpy as np

import simpar.mindspore as ms  # under MindSpore: import mindspore as ms

STRATEGY_FILE = "./recursive_programming_strategy.json"
FEATURES, HIDDEN, CLASSES = 64, 512, 10
SAMPLES, BATCH_PER_DEVICE = 256, 4


class Network(ms.nn.Cell):
    """Three Dense layers with ReLU between them."""

    def __init__(self):
        super().__init__()
        self.fc1 = ms.nn.Dense(FEATURES, HIDDEN)
        self.relu1 = ms.ops.ReLU()
        self.fc2 = ms.nn.Dense(HIDDEN, HIDDEN)
        self.relu2 = ms.ops.ReLU()
        self.fc3 = ms.nn.Dense(HIDDEN, CLASSES)

    def construct(self, x):
        return self.fc3(self.relu2(self.fc2(self.relu1(self.fc1(x)))))


def create_dataset(batch_size, num_shards=None, shard_id=None):
    rng = np.random.default_rng(0)
    features = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    labels = np.argmax(features @ rng.standard_normal((FEATURES, CLASSES)), axis=1)
    dataset = ms.dataset.GeneratorDataset(
        list(zip(features, labels.astype(np.int32))), column_names=["data", "label"],
        shuffle=True, num_shards=num_shards, shard_id=shard_id)
    return dataset.batch(batch_size, drop_remainder=True)


def main(epochs=1, callbacks=()):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.communication.init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.AUTO_PARALLEL,
                                 search_mode="recursive_programming",
                                 strategy_ckpt_config={"save_file": STRATEGY_FILE})
    ms.set_seed(1)
    net = Network()
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
