"""The real-application bench's parts (bench/realapp.py): MediaWiki's set-up and page recipe, its
private Apache and php-fpm, the two-stage workload, Overtake's deployment and the statistics."""
