"""quickstart-async: a Flower quickstart app trained asynchronously with flwr-gsgm."""
