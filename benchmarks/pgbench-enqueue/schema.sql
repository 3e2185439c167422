DROP TABLE IF EXISTS bench_events, bench_accounts, bench_raw_outbox, ok_keys, ok_outbox, ok_relays, hk_keys, hk_outbox;
CREATE TABLE bench_events (id BIGSERIAL PRIMARY KEY, account INT NOT NULL, amount INT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE TABLE bench_accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL);
INSERT INTO bench_accounts SELECT g, 0 FROM generate_series(0, 999) g;
CREATE TABLE bench_raw_outbox (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, msg_id TEXT NOT NULL, payload BYTEA NOT NULL);
CREATE TABLE ok_keys (ordering_key TEXT COLLATE "C" PRIMARY KEY, last_seq BIGINT NOT NULL, acked_seq BIGINT NOT NULL DEFAULT 0,
  available_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity', lease_token BIGINT NOT NULL DEFAULT 0, attempts INT NOT NULL DEFAULT 0,
  last_error TEXT, parked BOOLEAN NOT NULL DEFAULT false, parked_at TIMESTAMPTZ);
CREATE INDEX ok_keys_due ON ok_keys (available_at) WHERE acked_seq < last_seq AND NOT parked;
CREATE TABLE ok_outbox (ordering_key TEXT COLLATE "C" NOT NULL, seq BIGINT NOT NULL, id TEXT NOT NULL, topic TEXT NOT NULL,
  headers TEXT NOT NULL, payload BYTEA NOT NULL, created_at TIMESTAMPTZ NOT NULL, PRIMARY KEY (ordering_key, seq));
CREATE TABLE ok_relays (relay_id TEXT PRIMARY KEY, idle_until TIMESTAMPTZ NOT NULL, seen_at TIMESTAMPTZ NOT NULL);
CREATE TABLE hk_keys (ordering_key TEXT COLLATE "C" PRIMARY KEY, last_seq BIGINT NOT NULL, acked_seq BIGINT NOT NULL DEFAULT 0,
  available_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity', lease_token BIGINT NOT NULL DEFAULT 0, attempts INT NOT NULL DEFAULT 0,
  last_error TEXT, parked BOOLEAN NOT NULL DEFAULT false, parked_at TIMESTAMPTZ, pending BOOLEAN NOT NULL DEFAULT true);
CREATE INDEX hk_keys_due ON hk_keys (available_at) WHERE pending AND NOT parked;
CREATE TABLE hk_outbox (LIKE ok_outbox INCLUDING ALL);
