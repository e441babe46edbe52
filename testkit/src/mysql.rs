//! A database of one test's own on the MySQL / MariaDB server, and an administrator's
//! view of its named locks.

use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySqlPool, Row};

/// The MySQL or MariaDB server the tests use: `MYSQL_URL`, default
/// `mysql://root@127.0.0.1:3306/test`.
pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".to_string())
}

/// Connects as the tests' administrator, failing loudly when the server is missing.
pub async fn admin_pool(url: &str) -> MySqlPool {
    match MySqlPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
    {
        Ok(p) => p,
        Err(e) => panic!(
            "MySQL/MariaDB at {url} is not reachable ({e}); start it (.ci/run does) or point \
             MYSQL_URL at a server"
        ),
    }
}

/// `base` with its database replaced by `database`.
pub fn with_database(base: &str, database: &str) -> String {
    let authority = base.find("://").map(|i| i + 3).unwrap_or(0);
    let path = base[authority..]
        .find('/')
        .map(|i| authority + i)
        .unwrap_or(base.len());
    let query = base[path..]
        .find('?')
        .map(|i| &base[path + i..])
        .unwrap_or("");
    format!("{}/{database}{query}", &base[..path])
}

/// A database of one test's own (lock names, fencing and migration tables all include
/// it), dropped at the end unless the test failed.
pub struct MyDb {
    pub name: String,
    pub url: String,
    admin: MySqlPool,
}

impl MyDb {
    pub async fn new(tag: &str) -> MyDb {
        let base = mysql_url();
        let name = crate::unique(tag);
        let admin = admin_pool(&base).await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
            .execute(&admin)
            .await
            .unwrap();
        let url = with_database(&base, &name);
        MyDb { name, url, admin }
    }

    pub fn admin(&self) -> &MySqlPool {
        &self.admin
    }

    /// Creates `user` (dropped first if it exists) that may read this database but not
    /// create tables in it or grant anything; its URL on this database. Drop it with
    /// [`MyDb::drop_user`].
    pub async fn read_only_user(&self, user: &str) -> String {
        for sql in [
            format!("DROP USER IF EXISTS '{user}'@'%'"),
            format!("CREATE USER '{user}'@'%'"),
            format!("GRANT SELECT ON `{}`.* TO '{user}'@'%'", self.name),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&self.admin)
                .await
                .unwrap();
        }
        let at = self.url.find('@').unwrap();
        format!("mysql://{user}{}", &self.url[at..])
    }

    /// Drops `user`, if it exists.
    pub async fn drop_user(&self, user: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP USER IF EXISTS '{user}'@'%'"
        )))
        .execute(&self.admin)
        .await
        .unwrap();
    }

    /// A handle on this database.
    pub async fn locks(&self) -> dblock::Locks {
        dblock::Locks::connect(&self.url).await.unwrap()
    }

    /// The `GET_LOCK` name of `name` (default namespace) on this database.
    pub fn lock_name(&self, name: &str) -> String {
        dblock::mysql::lock_name(&self.name, dblock::Key::new("public", name).unwrap())
    }

    /// `IS_USED_LOCK(lock_name)`: the holder's connection id.
    pub async fn holder(&self, lock_name: &str) -> Option<u64> {
        sqlx::query("SELECT CAST(IS_USED_LOCK(?) AS UNSIGNED)")
            .bind(lock_name)
            .fetch_one(&self.admin)
            .await
            .unwrap()
            .get(0)
    }

    /// Polls until `lock_name` has no holder, for at most `secs`; returns whether it
    /// came free.
    pub async fn eventually_free(&self, lock_name: &str, secs: u64) -> bool {
        crate::eventually(secs, &mut || async {
            self.holder(lock_name).await.is_none()
        })
        .await
    }

    /// `KILL CONNECTION id`.
    pub async fn kill_connection(&self, id: u64) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .execute(&self.admin)
            .await
            .unwrap();
    }
}

impl Drop for MyDb {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("test database {} left in place for inspection", self.name);
            return;
        }
        let base = mysql_url();
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(p) = MySqlPoolOptions::new()
                    .max_connections(1)
                    .connect(&base)
                    .await
                {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS `{name}`"
                    )))
                    .execute(&p)
                    .await;
                    p.close().await;
                }
            });
        })
        .join();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn database_is_replaced_in_urls() {
        use super::with_database;
        assert_eq!(
            with_database("mysql://root@127.0.0.1:3306/test", "x"),
            "mysql://root@127.0.0.1:3306/x"
        );
        assert_eq!(
            with_database("mysql://root@h/test?ssl-mode=disabled", "x"),
            "mysql://root@h/x?ssl-mode=disabled"
        );
        assert_eq!(with_database("mysql://root@h", "x"), "mysql://root@h/x");
    }
}
