"""Client side of flwr-gsgm: data, partitioning, model, local training, ClientApp.

Modules (one concept each):

- :mod:`clients.datasets`: ``load_dataset(name, root) -> (train, test)`` as
  :class:`~clients.datasets.ImageData` tensors, from a small name registry.
- :mod:`clients.partitioning`: per-node row indices with flwr-datasets partitioners.
- :mod:`clients.models`: the CNN per dataset, ``get_weights`` / ``set_weights``.
- :mod:`clients.training`: ``compute_update`` (gradient / delta / weights) and
  ``evaluate``, pure PyTorch.
- :mod:`clients.client_app`: the Flower ``ClientApp`` and its message protocol.
- :mod:`clients.local_data`: a board's own images (node config ``data-dir``,
  torchvision ``ImageFolder``) and the on-disk data cache (``cache-dir``).
- :mod:`clients.device`: CUDA if available, else CPU (node config ``device``).
"""
